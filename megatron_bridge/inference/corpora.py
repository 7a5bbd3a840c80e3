"""Evaluation data, read into scored sequences (see `scoring.Scored`).

Formats, told apart by the file (or the keys of its first JSON line):
- `text`: JSONL of `{"text": ...}` (`text_key` renames the field);
- `indexed`: our `PREFIX.bin` + `PREFIX.idx` (give the prefix or either file);
- `sft`: fine-tuning JSONL, `{"input", "output"}` or `{"messages"}`: the loss covers what
  fine-tuning trains on (the answer and its end-of-document token; the assistant turns);
- `choice`: multiple choice, `{"context", "choices", "label"}` (see `choices`).

Text documents are scored one by one, each encoded with the tokenizer's default encoding and
truncated to `seq_length` tokens; with `concat`, documents (text or indexed) are joined as
pretraining joins them (each followed by the end-of-document token, as `mbridge data preprocess
--append-eod` writes them) and cut into windows of `seq_length` + 1 tokens that overlap by one,
so every token after the first is predicted once with up to `seq_length` tokens of context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from megatron_bridge.inference.errors import DataError, json_lines
from megatron_bridge.data.chat import ChatFormatError
from megatron_bridge.data.hf_local import SUFFIX_FORMATS, DataSourceError, LocalSplit
from megatron_bridge.data.sft_records import detect_format as detect_sft
from megatron_bridge.config.paths import file_kind

TEXT, INDEXED, SFT, CHOICE = "text", "indexed", "sft", "choice"
FORMATS = (TEXT, INDEXED, SFT, CHOICE)
CHOICE_KEYS = ("context", "choices", "label")


@dataclass
class Scored:
    """Token ids and which of them count (see `scoring`)."""

    ids: np.ndarray
    weights: np.ndarray
    """weights[t] = 1 counts the prediction of ids[t] (weights[0] is never used)."""

    @classmethod
    def all_tokens(cls, ids: Sequence[int]) -> "Scored":
        weights = np.ones(len(ids), dtype=np.float64)
        if len(ids):
            weights[0] = 0.0
        return cls(np.asarray(ids, dtype=np.int64), weights)

    @property
    def counted(self) -> int:
        return int(self.weights[1:].sum())




def indexed_prefix(path: str) -> Optional[str]:
    """The prefix of an indexed dataset named by `path` (the prefix, its .bin or its .idx)."""
    for prefix in (path[: -len(".bin")] if path.endswith(".bin") else None,
                   path[: -len(".idx")] if path.endswith(".idx") else None, path):  # fmt: skip
        if prefix and os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
            return prefix
    return None


def detect_format(path: str, text_key: str) -> str:
    """Which format `path` holds (see the module docstring)."""
    if indexed_prefix(path):
        return INDEXED
    if not os.path.isfile(path):
        kind = file_kind(path)
        what = "does not exist" if kind == "missing" else f"is {kind}, not a data file"
        raise DataError(f"--data {path!r} {what} (give a JSONL file, or the prefix of PREFIX.bin/PREFIX.idx)")
    first = next(iter(jsonl_rows(path)), None)
    if first is None:
        raise DataError(f"--data {path!r} holds no lines")
    where, row = first
    if all(k in row for k in CHOICE_KEYS):
        return CHOICE
    if text_key in row:
        return TEXT
    if "messages" in row or ("input" in row and "output" in row):
        return SFT
    raise DataError(
        f"{where}: keys {sorted(row)} match no evaluation format: text needs {text_key!r} (--text-key), multiple "
        f"choice {list(CHOICE_KEYS)}, fine-tuning data 'input'/'output' or 'messages'"
    )


def jsonl_rows(path: str) -> Iterator[tuple[str, dict]]:
    """(location, object) of every non-empty line of a JSONL file."""
    for where, row in json_lines(path, DataError):
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, found {type(row).__name__}")
        yield where, row


def text_documents(path: str, text_key: str) -> Iterator[str]:
    for where, row in jsonl_rows(path):
        value = row.get(text_key)
        if not isinstance(value, str):
            raise DataError(f"{where}: no text in {text_key!r} (found keys {sorted(row)}; --text-key names the field)")
        yield value


def text_sequences(path: str, text_key: str, tokenizer: Any, seq_length: int, concat: bool) -> list[Scored]:
    texts = list(text_documents(path, text_key))
    if concat:
        documents = [ids for ids in tokenizer.tokenize_batch(texts) if ids]
        return windows(documents, tokenizer.eod, seq_length)
    return [Scored.all_tokens(tokenizer.encode(text)[:seq_length]) for text in texts]


def indexed_sequences(prefix: str, seq_length: int, concat: bool) -> list[Scored]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(prefix, multimodal=False, mmap=True)
    bounds = data.document_indices
    documents = []
    for d in range(len(bounds) - 1):
        parts = [data[s] for s in range(int(bounds[d]), int(bounds[d + 1]))]
        documents.append(np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64))
    if concat:
        return windows(documents, None, seq_length)
    return [Scored.all_tokens(doc[:seq_length]) for doc in documents]


def windows(documents: list, eod: Optional[int], seq_length: int) -> list[Scored]:
    """Documents joined (`eod` after each when given) and cut into windows of seq_length + 1
    tokens, consecutive windows sharing one token."""
    pieces = []
    for doc in documents:
        pieces.append(np.asarray(doc, dtype=np.int64))
        if eod is not None:
            pieces.append(np.asarray([eod], dtype=np.int64))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return [Scored.all_tokens(stream[start : start + seq_length + 1]) for start in range(0, max(len(stream) - 1, 0), seq_length)]


def sft_sequences(path: str, tokenizer: Any, seq_length: int) -> list[Scored]:
    """Fine-tuning rows as fine-tuning tokenizes them, the loss mask where it trains."""
    from megatron_bridge.data.finetuning import SampleEncoder, _valid_records

    if os.path.splitext(path)[1] not in SUFFIX_FORMATS:
        raise DataError(f"{path!r}: fine-tuning data is read from {', '.join(sorted(SUFFIX_FORMATS))} files")
    source = LocalSplit("eval", files=(path,))
    try:
        fmt = detect_sft(source.columns(), {}, source.describe())
        null_vocab = tokenizer.vocab_size if type(tokenizer).__name__ == "NullTokenizer" else None
        encoder = SampleEncoder(tokenizer, fmt, seq_length)
        out = []
        for record in _valid_records(source, fmt, null_vocab, None):
            ids, flags = encoder.encode(record)
            weights = flags.astype(np.float64)
            if len(weights):
                weights[0] = 0.0
            out.append(Scored(np.asarray(ids, dtype=np.int64), weights))
        return out
    except (DataSourceError, ChatFormatError, ValueError) as exc:  # ValueError: a bad row, named
        raise DataError(str(exc)) from None
