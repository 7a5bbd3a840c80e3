"""Megatron indexed datasets (`PREFIX.bin` + `PREFIX.idx`): a writer for many documents at a
time, and a reader of the index header that checks the pair belongs together.

The writer produces the files megatron-core's `IndexedDatasetBuilder` produces, byte for byte,
but appends many documents at once and keeps its index compact (4 bytes per sequence, not a
Python int), so its memory stays small on large corpora; it needs neither torch nor
megatron-core. It writes under temporary names and moves both files to their final names only
when complete: an interrupted run leaves nothing under the final names.
"""

from __future__ import annotations

import os
import struct
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
"""megatron-core's dtype codes of the .idx header."""


def token_dtype(vocab_size: int) -> type:
    """The smallest dtype megatron-core uses for a vocabulary: uint16 below 65,500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetWriter:
    """Writes `prefix.bin/.idx` (see the module docstring): `add_documents` many at a time,
    `finalize()` commits, `abort()` removes what was written."""

    def __init__(self, prefix: str, dtype: type):
        self.prefix = prefix
        self.dtype = np.dtype(dtype).type
        self._tmp = f".tmp-{os.getpid()}"
        self.data_file = open(prefix + ".bin" + self._tmp, "wb")
        self.sequence_lengths = array("i")
        self.document_indices = array("q", [0])
        self.tokens = 0

    def add_document(self, ids: Any, lengths: list[int]) -> None:
        """One document (IndexedDatasetBuilder.add_document): its ids and sequence lengths."""
        self.add_documents(np.asarray(ids), np.asarray(lengths), np.asarray([len(lengths)]))

    def add_documents(self, ids: np.ndarray, sequence_lengths: np.ndarray, sequences_per_document: np.ndarray) -> None:
        """Append documents given as one flat array of token ids, the length of each sequence
        (sentence), and the number of sequences of each document."""
        self.data_file.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.tokens += int(np.size(ids))
        first = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(np.ascontiguousarray(sequence_lengths, dtype=np.int32).tobytes())
        ends = first + np.cumsum(sequences_per_document, dtype=np.int64)
        self.document_indices.frombytes(ends.tobytes())

    @property
    def documents(self) -> int:
        return len(self.document_indices) - 1

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        self.data_file.close()
        idx_tmp = self.prefix + ".idx" + self._tmp
        write_index(idx_tmp, self.dtype, np.frombuffer(self.sequence_lengths, dtype=np.int32), np.frombuffer(self.document_indices, dtype=np.int64))
        os.replace(self.prefix + ".bin" + self._tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")

    def abort(self) -> None:
        """Close and delete the temporary files."""
        if not self.data_file.closed:
            self.data_file.close()
        for suffix in (".bin", ".idx"):
            try:
                os.remove(self.prefix + suffix + self._tmp)
            except FileNotFoundError:
                pass


def write_index(path: str, dtype: type, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """The .idx layout of megatron-core's `_IndexWriter` (without sequence modes)."""
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(sequence_lengths), dtype=np.int64)
    if len(sequence_lengths) > 1:
        np.cumsum(sequence_lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    code = next(c for c, t in DTYPE_CODES.items() if np.dtype(t) == np.dtype(dtype))
    with open(path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sequence_lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(np.asarray(sequence_lengths, dtype=np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.asarray(document_indices, dtype=np.int64).tobytes())


@dataclass(frozen=True)
class IndexHeader:
    """What an .idx file says about its .bin."""

    dtype: type
    sequences: int
    documents: int
    """Documents (the index stores one more document boundary than this)."""
    bin_bytes: int
    """The size the .bin must have."""

    @property
    def tokens(self) -> int:
        return self.bin_bytes // np.dtype(self.dtype).itemsize


def read_index_header(prefix: str) -> IndexHeader:
    """The header of `prefix.idx`, checked against the index's own length; raises ValueError
    for a file that is not a megatron index (or is truncated), OSError when unreadable."""
    path = prefix + ".idx"
    with open(path, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != INDEX_HEADER:
            raise ValueError(f"{path} is not a megatron-core index (bad header)")
        version, code, sequences, documents = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in DTYPE_CODES:
            raise ValueError(f"{path}: unknown index version {version} or dtype code {code}")
        if documents < 1:
            raise ValueError(f"{path} has no document boundaries")
        size = os.fstat(f.fileno()).st_size
        minimum = 34 + 12 * sequences + 8 * documents
        if size < minimum:
            raise ValueError(f"{path} is truncated ({size} bytes, its header needs {minimum})")
        bin_bytes = 0
        if sequences:
            f.seek(34 + 4 * (sequences - 1))
            last_length = struct.unpack("<i", f.read(4))[0]
            f.seek(34 + 4 * sequences + 8 * (sequences - 1))
            last_pointer = struct.unpack("<q", f.read(8))[0]
            bin_bytes = last_pointer + last_length * np.dtype(DTYPE_CODES[code]).itemsize
    return IndexHeader(DTYPE_CODES[code], sequences, max(documents - 1, 0), bin_bytes)


_CHUNK = 1 << 20
"""Sequences read at a time by the checks of an index's arrays (12 MiB of the .idx)."""


def _index_arrays(prefix: str, header: IndexHeader) -> tuple[np.ndarray, np.ndarray]:
    """The sequence lengths and byte offsets of `prefix.idx`, memory-mapped (nothing read yet)."""
    n = header.sequences
    lengths = np.memmap(prefix + ".idx", dtype=np.int32, mode="r", offset=34, shape=(n,))
    pointers = np.memmap(prefix + ".idx", dtype=np.int64, mode="r", offset=34 + 4 * n, shape=(n,))
    return lengths, pointers


def check_index_arrays(prefix: str, header: IndexHeader) -> None:
    """Raise ValueError unless every sequence of `prefix.idx` has a length of at least 0 and
    starts in the .bin where the one before it ends, and the document boundaries run from 0 up to
    the sequence count: what megatron-core's reader and its sample index take for granted (a
    negative length makes its epoch count never end, an offset past the .bin fails in the middle
    of building). Read in chunks, so memory stays small."""
    _check_document_boundaries(prefix, header)
    if header.sequences == 0:
        return
    lengths, pointers = _index_arrays(prefix, header)
    itemsize = np.dtype(header.dtype).itemsize
    offset = 0
    for start in range(0, header.sequences, _CHUNK):
        chunk = np.asarray(lengths[start : start + _CHUNK], dtype=np.int64)
        if chunk.min() < 0:
            at = int(chunk.argmin())
            raise ValueError(f"{prefix}.idx gives sequence {start + at:,} a negative length ({int(chunk[at]):,})")
        expected = offset + np.concatenate(([0], np.cumsum(chunk[:-1] * itemsize)))
        wrong = np.flatnonzero(np.asarray(pointers[start : start + _CHUNK]) != expected)
        if wrong.size:
            at = int(wrong[0])
            raise ValueError(
                f"{prefix}.idx puts sequence {start + at:,} at byte {int(pointers[start + at]):,} of the .bin, "
                f"where the sequences before it end at byte {int(expected[at]):,}"
            )
        offset = int(expected[-1] + chunk[-1] * itemsize)


def _check_document_boundaries(prefix: str, header: IndexHeader) -> None:
    n = header.documents + 1
    boundaries = np.memmap(prefix + ".idx", dtype=np.int64, mode="r", offset=34 + 12 * header.sequences, shape=(n,))
    first, last = int(boundaries[0]), int(boundaries[-1])
    if first != 0 or last != header.sequences:
        raise ValueError(f"{prefix}.idx: its document boundaries run from {first:,} to {last:,}, not from 0 to its {header.sequences:,} sequences")
    previous = 0
    for start in range(0, n, _CHUNK):
        chunk = np.asarray(boundaries[start : start + _CHUNK])
        if chunk.max() > header.sequences:
            at = start + int(chunk.argmax())
            raise ValueError(f"{prefix}.idx: document boundary {at:,} ({int(boundaries[at]):,}) is past its {header.sequences:,} sequences")
        steps = np.diff(chunk, prepend=previous)
        if steps.min() < 0:
            at = start + int(steps.argmin())
            raise ValueError(f"{prefix}.idx: document boundary {at:,} ({int(boundaries[at]):,}) is less than the one before it ({int(boundaries[at - 1]):,})")
        previous = int(chunk[-1])


def sequence_tokens(prefix: str, header: IndexHeader, begin: int, end: int) -> int:
    """The tokens of sequences `begin` to `end` (exclusive) of `prefix`, from its index."""
    if begin >= end:
        return 0
    lengths, _ = _index_arrays(prefix, header)
    return sum(int(np.sum(lengths[s : min(s + _CHUNK, end)], dtype=np.int64)) for s in range(begin, end, _CHUNK))


def largest_token_id(prefix: str, dtype: type, max_tokens: int = 1 << 22) -> int:
    """The largest token id in up to `max_tokens` of `prefix.bin`, read in 16 evenly spaced windows."""
    if os.path.getsize(prefix + ".bin") < np.dtype(dtype).itemsize:  # numpy maps no empty file
        return -1
    data = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    window = max(1, min(data.size, max_tokens) // 16)
    starts = np.linspace(0, max(data.size - window, 0), 16).astype(np.int64)
    return int(max(int(data[s : s + window].max()) for s in np.unique(starts)))
