"""megatron-core model chunks out to a Hugging Face directory: sharded safetensors with an index,
config.json and the tokenizer files.

Every rank takes part. For each parameter, the ranks holding its tensor-parallel parts (data- and
expert-data-parallel rank 0) gather them on tensor-parallel rank 0, which converts them to the
Hugging Face tensors and appends them to its current output file. Files are planned up front from
the shapes alone, so the writers (one per pipeline stage and expert-parallel rank) write their own
files in parallel and hold at most one file's tensors besides their model part: no rank ever
holds the whole model. A Hugging Face tensor that stacks every expert of a layer (a rule with a
`stack_index`) is assembled by the writer of expert-parallel rank 0 from the slices of all
expert-parallel ranks: it holds one layer's stacked tensors at a time. The directory is written
under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from megatron_bridge.models.hf import mapping
from megatron_bridge.models.hf.files import (
    CONFIG_FILE, EXPORT_FIX, INDEX_FILE, ORIGIN_FILES, SINGLE_FILE, check_replaceable, copy_tokenizer_files, written_by_export,
)
from megatron_bridge.models.hf.load import named_global_parameters
from megatron_bridge.peft.apply import adapters

logger = logging.getLogger("megatron_bridge")

DEFAULT_SHARD_BYTES = 5 * 1024**3
INCOMPLETE_SUFFIX = ".incomplete"
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}  # fmt: skip
"""Accepted dtype spellings -> the torch/config.json name."""


@dataclass
class _Item:
    """One parameter this rank takes part in writing."""

    name: str
    param: Any
    part: mapping.Partition
    rule: mapping.Rule
    group: Any
    """Tensor-parallel group to gather over (None: not split)."""
    writer: bool
    """This rank writes the result (tensor-parallel rank 0 of the group)."""
    adapter: Any = None
    """The LoRA/DoRA adapter on the layer whose weight this is: written folded in."""
    holder: Optional[bool] = None
    """This rank holds the whole parameter after the tensor-parallel gather (None: `writer`);
    differs from `writer` for a slice of a stacked tensor on expert-parallel ranks other than 0."""
    stack_group: Any = None
    """Expert-parallel group over which the slices of a stacked tensor go to its writer."""

    @property
    def holds(self) -> bool:
        return self.writer if self.holder is None else self.holder


@dataclass
class _Plan:
    files: list[tuple[int, list[str]]] = field(default_factory=list)
    """(writing rank, tensor names) per output file, in file order."""
    nbytes: dict[str, int] = field(default_factory=dict)
    """Bytes of each output tensor."""


def torch_dtype(name: str):
    import torch

    key = DTYPES.get(str(name).replace("torch.", ""))
    if key is None:
        raise ValueError(f"unsupported dtype {name!r} (use bf16, fp16 or fp32)")
    return getattr(torch, key)


def dtype_entries(dtype: Any) -> dict[str, str]:
    """config.json's weights dtype under both of its keys: `dtype`, which transformers 5 writes
    and reads first, and `torch_dtype`, which earlier releases and other readers of config.json
    use."""
    name = str(dtype).replace("torch.", "")
    return {"dtype": name, "torch_dtype": name}


def _items(chunks: list[Any], hf: dict) -> list[_Item]:
    """The parameters this rank gathers or writes: dense ones from data-parallel rank 0, expert
    ones from expert-data-parallel rank 0; dense first, then experts (same order on every rank
    of a group, so the gathers pair up)."""
    from megatron.core import parallel_state as ps

    dense_owner = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    dense_writer = dense_owner and ps.get_tensor_model_parallel_rank() == 0
    expert_owner = ps.get_expert_data_parallel_rank() == 0 if mapping.architecture(hf).num_experts else False
    expert_writer = expert_owner and ps.get_expert_tensor_parallel_rank() == 0
    ep = ps.get_expert_model_parallel_world_size()

    dense, experts = [], []
    for chunk in chunks:
        adapted = {id(a.base_layer.weight): a for a in adapters(chunk)}
        for name, param, rule, part in named_global_parameters(chunk, hf):
            is_expert = mapping.is_expert(name)
            if not (expert_owner if is_expert else dense_owner):
                continue
            split = part.dim is not None and part.size > 1
            if is_expert:
                group = ps.get_expert_tensor_parallel_group() if split else None
            else:
                group = ps.get_tensor_model_parallel_group() if split else None
            writer = expert_writer if is_expert else dense_writer
            item = _Item(name, param, part, rule, group, writer, adapted.get(id(param)))
            if is_expert and getattr(rule, "stack_index", None) is not None:
                item.holder, item.writer = writer, writer and ps.get_expert_model_parallel_rank() == 0
                item.stack_group = ps.get_expert_model_parallel_group() if ep > 1 else None
            (experts if is_expert else dense).append(item)
    return dense + experts


def _plan(items: list[_Item], dtype: Any, max_bytes: int) -> _Plan:
    """Every rank's output tensors (from shapes only) packed into files: each writer fills its
    own files in parameter order, writers in rank order."""
    import torch.distributed as dist

    mine, listed = [], set()
    for item in items:
        if not item.writer:
            continue
        shape = list(item.param.shape)
        if item.part.dim is not None:
            shape[item.part.dim] *= item.part.size
        itemsize = _itemsize(_dtype_of(item.rule, dtype))
        for hf_name, hf_shape in item.rule.hf_shapes(tuple(shape)).items():
            if hf_name in listed:  # a stacked tensor: one entry for all its slices
                continue
            listed.add(hf_name)
            numel = 1
            for d in hf_shape:
                numel *= d
            mine.append((hf_name, numel * itemsize))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    plan, seen = _Plan(), set()
    for rank, tensors in enumerate(everyone):
        current, size = [], 0
        for name, nbytes in tensors:
            if name in seen:
                raise ValueError(f"two ranks write Hugging Face tensor {name!r}")
            seen.add(name)
            plan.nbytes[name] = nbytes
            if current and size + nbytes > max_bytes:
                plan.files.append((rank, current))
                current, size = [], 0
            current.append(name)
            size += nbytes
        if current:
            plan.files.append((rank, current))
    return plan


def _dtype_of(rule: mapping.Rule, dtype: Any) -> Any:
    """The dtype `rule`'s tensors are written in when the export's is `dtype`."""
    return torch_dtype(rule.export_dtype) if rule.export_dtype else dtype


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _file_names(plan: _Plan) -> list[str]:
    n = len(plan.files)
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _gather(item: _Item) -> Optional[list[Any]]:
    """The parameter's parts from every rank of its tensor-parallel group, on the writer (CPU)."""
    import torch
    import torch.distributed as dist

    # An adapted weight is folded in here, one layer at a time, in fp32 (rounded once, to the
    # output dtype); DoRA's row norms of a row-parallel layer are summed over its group first.
    local = item.adapter.merged_weight(torch.float32) if item.adapter is not None else item.param.detach()
    if item.group is None:
        return [local.cpu()] if item.holds else None
    parts = [torch.empty_like(local) for _ in range(item.part.size)] if item.holds else None
    dst = dist.get_global_rank(item.group, 0)
    dist.gather(local.contiguous(), parts, dst=dst, group=item.group)
    return [p.cpu() for p in parts] if item.holds else None


def _gather_slices(item: _Item, parts: Optional[list[Any]]) -> list[tuple[str, int, Any]]:
    """(stacked tensor, index, slice) of this parameter on every expert-parallel rank, on the
    writer; the other ranks send theirs. Expert-parallel rank k holds experts k x local ...,
    so its slice of this local expert is the writer's index plus k x local."""
    import torch
    import torch.distributed as dist

    if not item.holds:
        return []
    ((name, piece),) = item.rule.to_hf(parts, item.part).items()
    index, count = item.rule.stack_index
    if item.stack_group is None:
        return [(name, index, piece)]
    size = dist.get_world_size(item.stack_group)
    piece = piece.to(item.param.device).contiguous()  # where the process group's backend sends from (NCCL: the GPU)
    received = [torch.empty_like(piece) for _ in range(size)] if item.writer else None
    dist.gather(piece, received, dst=dist.get_global_rank(item.stack_group, 0), group=item.stack_group)
    if not item.writer:
        return []
    local = count // size
    return [(name, index + k * local, t.cpu()) for k, t in enumerate(received)]


def write_hf_weights(chunks: list[Any], out_dir: str, hf_config: dict, dtype: Any,
                     tokenizer_source: Union[None, str, dict[str, Any]] = None, origin: Optional[str] = None,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Write the model held by `chunks` (on every rank) as a Hugging Face directory `out_dir`,
    weights in `dtype` (a torch dtype or 'bf16'/'fp16'/'fp32'), with `hf_config` as config.json,
    the tokenizer files of `tokenizer_source` and the generation config of `origin` (the Hugging
    Face directory the model came from). Call on every rank. Returns statistics."""
    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    rank = dist.get_rank()
    out_dir = os.path.realpath(out_dir) if os.path.islink(out_dir.rstrip("/")) else out_dir  # replace what the link names
    staging = out_dir.rstrip("/") + INCOMPLETE_SUFFIX
    if rank == 0:
        check_replaceable(out_dir, written_by_export, "an export", EXPORT_FIX, staged_beside=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    items = _items(chunks, hf_config)
    plan = _plan(items, dtype, max_shard_bytes)
    names = _file_names(plan)
    my_files = [(names[i], tensors) for i, (r, tensors) in enumerate(plan.files) if r == rank]
    dist.barrier()  # the staging directory exists
    pending: dict[str, Any] = {}
    stacks: dict[str, tuple[Any, set[int]]] = {}  # stacked tensors being assembled: tensor, slices in
    written = 0
    with torch.no_grad():
        for item in items:
            parts = _gather(item)
            out_dtype = _dtype_of(item.rule, dtype)
            if getattr(item.rule, "stack_index", None) is not None:
                for hf_name, index, piece in _gather_slices(item, parts):
                    count = item.rule.stack_index[1]
                    if hf_name not in stacks:
                        stacks[hf_name] = (torch.empty((count, *piece.shape), dtype=out_dtype), set())
                    stack, filled = stacks[hf_name]
                    stack[index].copy_(piece)
                    filled.add(index)
                    if len(filled) == count:
                        pending[hf_name] = stacks.pop(hf_name)[0]
            elif parts is not None:
                for hf_name, tensor in item.rule.to_hf(parts, item.part).items():
                    pending[hf_name] = tensor.to(dtype=out_dtype).contiguous()  # no copy when it already is
            del parts
            while my_files and all(t in pending for t in my_files[0][1]):
                file, tensors = my_files.pop(0)
                save_safetensors(os.path.join(staging, file), {t: pending.pop(t) for t in tensors})
                written += 1
    if my_files or pending or stacks:
        raise RuntimeError(f"rank {rank}: planned files {[f for f, _ in my_files]} were not completed")
    dist.barrier()  # every file is written
    total = sum(len(t) for _, t in plan.files)
    if rank == 0:
        config = dict(hf_config)
        config.update(dtype_entries(dtype))
        with open(os.path.join(staging, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        if len(names) > 1:
            _write_index(staging, plan, names)
        copy_tokenizer_files(tokenizer_source, staging)
        copy_tokenizer_files(origin, staging, ORIGIN_FILES)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.rename(staging, out_dir)
    dist.barrier()
    seconds = time.perf_counter() - started
    logger.info("wrote Hugging Face weights (%d tensors in %d files, %s) to %s in %.1f s",
                total, len(names), str(dtype).replace("torch.", ""), out_dir, seconds)  # fmt: skip
    return {"files": len(names), "tensors": total, "seconds": seconds, "written_by_this_rank": written}


SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def save_safetensors(path: str, tensors: dict[str, Any]) -> None:
    """Write contiguous CPU `tensors` as one safetensors file: an 8-byte header length, the JSON
    header (padded to 8 bytes), then each tensor's bytes in order, straight from its memory."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(t.dtype).replace("torch.", "")], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _write_index(directory: str, plan: _Plan, names: list[str]) -> None:
    weight_map = {tensor: file for file, (_, tensors) in zip(names, plan.files) for tensor in tensors}
    total = sum(plan.nbytes.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
