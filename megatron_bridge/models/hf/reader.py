"""Reading the safetensors weights of a Hugging Face directory: checked first, then sliced.

`check_weights` reads only the index and each file's header (a few KB): a missing shard, a
truncated file, a tensor listed in the index but absent from its file, a shape that does not
match config.json are all reported, each naming the file and the tensor, before any model is
built.

`SafetensorsReader.read_into` fills a parameter (or a part of one) with a slice of a tensor, and
reads only that slice's bytes. A slice of whole rows in the parameter's dtype is contiguous in
the file: it is read straight into the parameter's memory, with no copy in between. Any other
slice (columns, for row-parallel layers; a dtype conversion) goes through safetensors'
`safe_open(...).get_slice`, opened for that read only, so no file stays mapped between reads and
a process's memory holds its parameters plus at most one slice.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Optional

from megatron_bridge.config.errors import Problems, show
from megatron_bridge.models.hf.files import INDEX_FILE, SINGLE_FILE, read_json
from megatron_bridge.extras import require
from megatron_bridge.runtime import json_input

ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
              "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, from its file's header."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    """Position of its first byte in the file."""


class HeaderError(ValueError):
    """A file is not a complete safetensors file."""


def read_header(path: str) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file; `HeaderError` names the file (and the tensor) when
    it is not a safetensors file or is shorter than its header says."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{name}: {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or 8 + length > size:
            raise HeaderError(f"{name}: header of {length} bytes does not fit in the file ({size} bytes): truncated or not safetensors")
        try:
            header = json_input.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HeaderError(f"{name}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{name}: the safetensors header is not a JSON object")
    data_size = size - 8 - length
    out = {}
    for tensor, meta in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(int(x) for x in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise HeaderError(f"{name}: tensor {tensor!r} has a malformed header entry {show(meta)}") from None
        numel = 1
        for dim in shape:
            numel *= dim
        if dtype not in ITEM_SIZES or end - begin != numel * ITEM_SIZES[dtype] or begin < 0:
            raise HeaderError(f"{name}: tensor {tensor!r} has inconsistent dtype/shape/offsets {show(meta)}")
        if end > data_size:
            raise HeaderError(
                f"{name} is truncated: tensor {tensor!r} needs bytes up to {8 + length + end}, the file has {size}"
            )
        out[tensor] = TensorInfo(name, dtype, shape, 8 + length + begin)
    return out


def weight_map(directory: str) -> dict[str, str]:
    """{tensor: file} from model.safetensors.index.json, or every tensor of model.safetensors."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        data = read_json(index)
        mapping = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
            raise ValueError(f"{index}: no weight_map of tensor names to files")
        for file in set(mapping.values()):
            if os.path.basename(file) != file:
                raise ValueError(f"{index}: shard {file!r} is not a file name inside the directory")
        return dict(mapping)
    single = os.path.join(directory, SINGLE_FILE)
    if not os.path.isfile(single):
        raise ValueError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE}")
    return {tensor: SINGLE_FILE for tensor in read_header(single)}


def check_index(directory: str, expected: dict[str, tuple[int, ...]], problems: Problems,
                optional: tuple[str, ...] = (), ignored: Any = None) -> Optional[dict[str, str]]:
    """Problems for tensors config.json implies but the index lacks, and tensors the index lists
    that nothing uses; returns the weight map (None if unreadable). Reads no shard."""
    try:
        mapping = weight_map(directory)
    except (ValueError, HeaderError) as exc:
        problems.add("", str(exc), "point it at a complete Hugging Face model directory")
        return None
    source = INDEX_FILE if os.path.isfile(os.path.join(directory, INDEX_FILE)) else SINGLE_FILE
    missing = [t for t in expected if t not in mapping]
    if missing:
        problems.add(
            "",
            f"{source} has no tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""),
            "the weights do not match config.json; use the config.json they were saved with",
        )
    extra = [t for t in mapping if t not in expected and t not in optional and not (ignored and ignored.search(t))]
    if extra:
        problems.add(
            "",
            f"{source} lists tensor {extra[0]!r}, which config.json does not account for"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""),
            "the weights do not match config.json (another architecture or more layers?)",
        )
    return mapping


def check_weights(directory: str, expected: dict[str, tuple[int, ...]], problems: Problems,
                  optional: tuple[str, ...] = (), ignored: Any = None) -> Optional[dict[str, TensorInfo]]:
    """`check_index`, then every shard's presence and header: truncation, tensors missing from
    their file, shapes and dtypes against `expected`. Returns {tensor: TensorInfo} when all is well."""
    start = len(problems)
    mapping = check_index(directory, expected, problems, optional, ignored)
    if mapping is None:
        return None
    by_file: dict[str, list[str]] = {}
    for tensor, file in mapping.items():
        by_file.setdefault(file, []).append(tensor)
    infos: dict[str, TensorInfo] = {}
    for file, tensors in sorted(by_file.items()):
        path = os.path.join(directory, file)
        if not os.path.isfile(path):
            more = f" and {len(tensors) - 1} other tensors" if len(tensors) > 1 else ""
            problems.add("", f"shard {file} is missing (it holds {tensors[0]!r}{more})", "download the missing shard")
            continue
        try:
            header = read_header(path)
        except HeaderError as exc:
            problems.add("", str(exc), "download the file again")
            continue
        for tensor in tensors:
            info = header.get(tensor)
            if info is None:
                problems.add("", f"{file} has no tensor {tensor!r}, though the index lists it there", "download the file again")
                continue
            infos[tensor] = info
            want = expected.get(tensor)
            if want is not None and info.shape != want:
                problems.add(
                    "",
                    f"{file}: tensor {tensor!r} has shape {list(info.shape)}, config.json implies {list(want)}",
                    "the weights do not match config.json (vocab_size, heads, sizes); use the matching config.json",
                )
            if tensor in expected and info.dtype not in FLOAT_DTYPES:
                problems.add("", f"{file}: tensor {tensor!r} has dtype {info.dtype}", "convert floating-point weights")
    return infos if len(problems) == start else None


class SafetensorsReader:
    """Reads tensors, or slices of them, from a Hugging Face directory's safetensors files."""

    def __init__(self, directory: str, mapping: Optional[dict[str, str]] = None):
        self.directory = directory
        self.mapping = mapping if mapping is not None else weight_map(directory)
        self.bytes_read = 0
        self._headers: dict[str, dict[str, TensorInfo]] = {}

    def info(self, name: str) -> TensorInfo:
        file = self.mapping.get(name)
        if file is None:
            raise KeyError(f"{self.directory}: no tensor {name!r} in the weights")
        if file not in self._headers:
            self._headers[file] = read_header(os.path.join(self.directory, file))
        return self._headers[file][name]

    def read_into(self, dest, name: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None) -> None:
        """Fill `dest` with tensor `name`, or its [start, stop) slice along `dim` (shapes must
        agree exactly; the dtype is converted)."""
        import torch

        info = self.info(name)
        shape = list(info.shape)
        if dim is not None:
            stop = shape[dim] if stop is None else stop
            shape[dim] = stop - start
        if list(dest.shape) != shape:
            raise ValueError(f"{info.file}: tensor {name!r} gives shape {shape} here, the model expects {list(dest.shape)}")
        same_dtype = dest.dtype == getattr(torch, TORCH_DTYPES.get(info.dtype, "uint8"))
        if dim in (None, 0) and same_dtype and dest.device.type == "cpu" and dest.is_contiguous():
            row = dest.element_size()
            for d in info.shape[1:]:
                row *= d
            self._read_bytes(info, info.offset + (start if dim == 0 else 0) * row, dest)
            return
        dest.copy_(self.read(name, dim, start, stop))

    def mapped(self, name: str, dest, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None):
        """Tensor `name` (or its [start, stop) rows) as a view of the file mapped in memory, when
        that is exactly what `read_into(dest, ...)` would write into `dest` (shape, dtype, CPU);
        else None."""
        import torch

        info = self.info(name)
        shape = list(info.shape)
        if dim is not None:
            shape[dim] = (shape[dim] if stop is None else stop) - start
        same_dtype = dest.dtype == getattr(torch, TORCH_DTYPES.get(info.dtype, "uint8"))
        if dim not in (None, 0) or list(dest.shape) != shape or not same_dtype or dest.device.type != "cpu":
            return None
        return self.read(name, dim, start, stop)

    def _read_bytes(self, info: TensorInfo, offset: int, dest) -> None:
        """Read `dest`'s bytes from the file at `offset`, straight into its memory."""
        import torch

        buffer = memoryview(dest.view(-1).view(torch.uint8).numpy())
        with open(os.path.join(self.directory, info.file), "rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < len(buffer):
                n = f.readinto(buffer[done:])
                if not n:
                    raise ValueError(f"{info.file}: ends inside the data of a tensor (truncated?)")
                done += n
        self.bytes_read += len(buffer)

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None):
        """Tensor `name`, or its [start, stop) slice along `dim`, as stored (dtype included)."""
        safetensors = require("safetensors", "reading Hugging Face weights")
        file = self.mapping.get(name)
        if file is None:
            raise KeyError(f"{self.directory}: no tensor {name!r} in the weights")
        with safetensors.safe_open(os.path.join(self.directory, file), framework="pt") as f:
            if dim is None:
                tensor = f.get_tensor(name)
            else:
                view = f.get_slice(name)
                index = [slice(None)] * len(view.get_shape())
                index[dim] = slice(start, stop)
                tensor = view[tuple(index)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor
