"""Corpus preprocessing: text in JSONL, JSON, Parquet, Arrow or a `datasets` directory becomes
megatron indexed datasets (`<output_prefix>_<key>_document.bin/.idx`, `_sentence` with sentence
splitting), as Megatron-LM's `preprocess_data.py` writes them.

The input is cut into chunks (byte ranges of JSONL files, row groups, record batches, row
ranges) that worker processes read and tokenize themselves; the main process writes results in
input order, with a bounded number of chunks in flight. So the output does not depend on the
number of workers, and memory does not grow with the input. Output goes to temporary names and
is moved into place only when complete.
"""

from __future__ import annotations

import collections
import errno
import itertools
import json
import os
import re
import signal
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np

from megatron_bridge.data.hf_local import SUFFIX_FORMATS, DataSourceError, LocalSplit, open_arrow, select_split
from megatron_bridge.data.indexed import IndexedDatasetWriter, token_dtype
from megatron_bridge.extras import require
from megatron_bridge.runtime.child_processes import worker_pool
from megatron_bridge.runtime.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron_bridge.runtime.tokenizers.config import SENTENCEPIECE_TYPES, TEXT_TOKENIZER_TYPES, TokenizerConfig
from megatron_bridge.runtime.tokenizers.tokenizer import HuggingFaceTokenizer, build_tokenizer
from megatron_bridge.runtime import json_input
from megatron_bridge.runtime.writable import unwritable_reason

CHUNK_BYTES = 1 << 20
"""Bytes of JSONL per chunk."""

CHUNK_ROWS = 4096
"""Rows per chunk of a `datasets` directory."""


class PreprocessError(ValueError):
    """The input cannot be preprocessed as asked (the message names where and why)."""


@dataclass
class PreprocessOptions:
    """What `mbridge data preprocess` does (flags as in Megatron-LM's preprocess_data.py)."""

    input: str
    output_prefix: str
    tokenizer: Optional[str] = None
    """A Hugging Face tokenizer directory or tokenizer.json (for `HuggingFaceTokenizer`)."""
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    workers: int = 1
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    split: str = "train"
    """Which split of a `datasets` directory or a directory of data files to read."""
    tokenizer_kwargs: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    tokenizer_type: str = "HuggingFaceTokenizer"
    """`HuggingFaceTokenizer` (from `tokenizer`), `GPT2BPETokenizer` (from `vocab_file` and
    `merge_file`), or a SentencePiece type (from the `.model` file in `tokenizer`)."""
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None


def load_tokenizer(options: PreprocessOptions) -> Any:
    """The tokenizer `options` name; `PreprocessError` naming the flag at fault."""
    return tokenizer_from_flags(options.tokenizer_type, options.tokenizer, options.vocab_file, options.merge_file, options.tokenizer_kwargs)


def tokenizer_from_flags(
    tokenizer_type: str, tokenizer: Optional[str], vocab_file: Optional[str], merge_file: Optional[str], tokenizer_kwargs: Optional[dict] = None
) -> Any:
    """The tokenizer that `--tokenizer-type`, `--tokenizer`, `--vocab-file`, `--merge-file` and
    `--tokenizer-kwargs` name; `PreprocessError` naming the flag at fault."""
    if tokenizer_type == "GPT2BPETokenizer":
        missing = [flag for flag, value in (("--vocab-file", vocab_file), ("--merge-file", merge_file)) if not value]
        if missing:
            raise PreprocessError(f"--tokenizer-type GPT2BPETokenizer needs {' and '.join(missing)} (GPT-2's vocab.json and merges.txt)")
        for flag, value in (("--tokenizer", tokenizer), ("--tokenizer-kwargs", tokenizer_kwargs)):
            if value:
                raise PreprocessError(f"{flag} is for a HuggingFaceTokenizer; a GPT2BPETokenizer reads only --vocab-file and --merge-file")
        try:
            return GPT2BPETokenizer(vocab_file, merge_file)
        except (OSError, ValueError) as exc:
            text = str(exc)
            flag = "--merge-file" if text.startswith("tokenizer.merge_file: ") else "--vocab-file"
            raise PreprocessError(f"{flag}: {text.split(': ', 1)[1]}") from None
    if tokenizer_type not in TEXT_TOKENIZER_TYPES:
        raise PreprocessError(f"--tokenizer-type: {tokenizer_type!r} is not one of {', '.join(TEXT_TOKENIZER_TYPES)}")
    if not tokenizer:
        raise PreprocessError("--tokenizer: give a local tokenizer directory or tokenizer.json (a SentencePiece .model for the SentencePiece types; --tokenizer-type GPT2BPETokenizer reads --vocab-file and --merge-file)")
    if tokenizer_type in SENTENCEPIECE_TYPES:
        if tokenizer_kwargs:
            raise PreprocessError(f"--tokenizer-kwargs is for a HuggingFaceTokenizer; a {tokenizer_type} reads only --tokenizer")
        cfg = TokenizerConfig(tokenizer_type=tokenizer_type, tokenizer_model=tokenizer)
        try:
            return build_tokenizer(cfg)
        except (OSError, ValueError) as exc:
            raise PreprocessError(f"--tokenizer: {str(exc).removeprefix('tokenizer.tokenizer_model: ')}") from None
    try:
        return HuggingFaceTokenizer(tokenizer, hf_kwargs=tokenizer_kwargs)
    except (FileNotFoundError, ValueError) as exc:
        raise PreprocessError(f"--tokenizer: {exc}") from None


@dataclass
class KeyResult:
    """What preprocessing wrote for one JSON key."""

    prefix: str
    documents: int
    tokens: int
    skipped_empty: int


# ---------------------------------------------------------------------- sentences
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=\S)")


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """Sentences of `text`: a break after . ! or ? (and closing quotes/brackets) followed by
    whitespace. The whitespace stays with the sentence before it when `keep_newlines`, so the
    sentences join back into the text; otherwise sentences are stripped."""
    pieces, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        end = match.end() if keep_newlines else match.start() + len(match.group(0).rstrip())
        pieces.append(text[start:end])
        start = match.end()
    pieces.append(text[start:])
    if keep_newlines:
        return [p for p in pieces if p]
    return [p.strip() for p in pieces if p.strip()]


# ---------------------------------------------------------------------- chunks of the input
def input_split(path: str, split: str) -> LocalSplit:
    """The part of the input to preprocess; a glob pattern selects several data files."""
    if any(c in path for c in "*?[") and not os.path.exists(path):
        import glob

        files = sorted(glob.glob(path))
        files = [f for f in files if os.path.splitext(f)[1] in SUFFIX_FORMATS]
        if not files:
            raise PreprocessError(f"--input {path!r} matches no data files ({', '.join(sorted(SUFFIX_FORMATS))})")
        return LocalSplit("train", files=tuple(files))
    try:
        chosen = select_split(path, split)
    except DataSourceError as exc:
        raise PreprocessError(f"--input: {exc}") from None
    if chosen is None:
        raise PreprocessError(f"--input {path!r} has no split {split!r} (choose one with --split)")
    if chosen.rows is not None:
        raise PreprocessError(f"--split {split!r}: preprocessing reads whole splits (drop the [start:stop] slice)")
    return chosen


def plan_chunks(source: LocalSplit) -> list[tuple]:
    """Chunks of `source` in input order: (kind, where, start, stop, weight); `weight` is the
    bytes or rows the progress bar counts."""
    if source.dataset_dir:
        rows = len(source.hf_dataset())
        return [("hf", source.dataset_dir, a, min(a + CHUNK_ROWS, rows), min(CHUNK_ROWS, rows - a)) for a in range(0, rows, CHUNK_ROWS)]
    chunks: list[tuple] = []
    for file in source.files:
        kind = SUFFIX_FORMATS[os.path.splitext(file)[1]]
        if kind == "parquet":
            pq = require("pyarrow.parquet", "reading Parquet files")

            meta = pq.ParquetFile(file).metadata
            chunks += [("parquet", file, g, g + 1, meta.row_group(g).num_rows) for g in range(meta.num_row_groups)]
        elif kind == "arrow":
            reader = open_arrow(file)
            sizes = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)] if hasattr(reader, "get_batch") else [b.num_rows for b in reader]
            batches_per_chunk = max(1, CHUNK_ROWS // max(1, max(sizes, default=1)))
            for b in range(0, len(sizes), batches_per_chunk):
                chunks.append(("arrow", file, b, min(b + batches_per_chunk, len(sizes)), sum(sizes[b : b + batches_per_chunk])))
        else:
            with open(file, "rb") as f:
                is_array = f.read(64).lstrip().startswith(b"[")
            size = os.path.getsize(file)
            if is_array:
                chunks.append(("json-array", file, 0, size, size))
            else:
                chunks += [("lines", file, a, min(a + CHUNK_BYTES, size), min(CHUNK_BYTES, size - a)) for a in range(0, size, CHUNK_BYTES)]
    return chunks


def _lines_of(file: str, start: int, stop: int) -> Iterator[bytes]:
    """The lines of `file` that start in [start, stop)."""
    with open(file, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line running into this range belongs to the previous chunk
        position = f.tell()
        while position < stop:
            line = f.readline()
            if not line:
                return
            yield line
            position += len(line)


def read_chunk(chunk: tuple, keys: list[str]) -> tuple[list[list[str]], int, list[str]]:
    """(texts per key, lines read, error messages) of one chunk."""
    kind, where, start, stop, _ = chunk
    texts: list[list[str]] = [[] for _ in keys]
    errors: list[str] = []
    lines = 0

    def take(record: Any, location: str) -> None:
        if not isinstance(record, dict):
            errors.append(f"{location}: expected a JSON object, got {type(record).__name__}")
            return
        for column, key in zip(texts, keys):
            value = record.get(key)
            if not isinstance(value, str):
                what = "no" if key not in record else f"a {type(value).__name__} in its"
                errors.append(f"{location}: {what} {key!r} field (its fields: {sorted(record)}; choose with --json-keys)")
                return
        for column, key in zip(texts, keys):
            column.append(record[key])

    if kind == "lines":
        for line in _lines_of(where, start, stop):
            lines += 1
            if not line.strip():
                continue
            try:
                record = json_input.loads(line.rstrip(b"\r\n"))
            except json.JSONDecodeError as exc:
                errors.append(f"line+{lines}: not valid JSON ({exc.msg}, column {exc.colno})")
                break
            take(record, f"line+{lines}")
            if errors:
                break
    elif kind == "json-array":
        for location, record in LocalSplit.json_records(where):
            take(record, location)
            if errors:
                break
    else:
        if kind == "hf":
            rows = LocalSplit("train", dataset_dir=where).hf_dataset()[start:stop]
            records = [dict(zip(rows, values)) for values in zip(*rows.values())] if rows else []
        elif kind == "parquet":
            pq = require("pyarrow.parquet", "reading Parquet files")

            records = pq.ParquetFile(where).read_row_group(start).to_pylist()
        else:
            reader = open_arrow(where)
            batches = (reader.get_batch(i) for i in range(start, stop)) if hasattr(reader, "get_batch") else itertools.islice(reader, start, stop)
            records = [r for b in batches for r in b.to_pylist()]
        for i, record in enumerate(records):
            where_in = {"hf": f"row {start + i}", "parquet": f"row group {start} row {i}"}.get(kind, f"record batch {start}+ row {i}")
            take(record, f"{where} {where_in}")
            if errors:
                break
    return texts, lines, errors


# ---------------------------------------------------------------------- workers
_WORKER: dict[str, Any] = {}


def _init_worker(options: PreprocessOptions, threads: bool) -> None:
    if not threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and stops the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a plain SIGTERM ends a worker (the main process handles its own)

    _WORKER["tokenizer"] = load_tokenizer(options)
    _WORKER["options"] = options
    _WORKER["dtype"] = token_dtype(_WORKER["tokenizer"].vocab_size)


def tokenize_texts(texts: list[str], tokenizer: Any, options: PreprocessOptions, dtype: type) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(flat ids, sequence lengths, sequences per document, empty documents skipped)."""
    if options.split_sentences:
        per_doc = [split_sentences(t, options.keep_newlines) for t in texts]
        pieces = [s for sentences in per_doc for s in sentences]
        counts = np.fromiter((len(s) for s in per_doc), dtype=np.int64, count=len(per_doc))
    else:
        pieces = texts
        counts = np.ones(len(texts), dtype=np.int64)
    encoded = tokenizer.tokenize_batch(pieces) if pieces else []
    lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
    ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=int(lengths.sum()))
    # empty sentences and documents leave no sequence (megatron's GPT datasets need one per document)
    keep_seq = lengths > 0
    doc_of_piece = np.repeat(np.arange(len(counts)), counts)
    counts = np.bincount(doc_of_piece[keep_seq], minlength=len(counts)).astype(np.int64)
    lengths = lengths[keep_seq]
    skipped = int((counts == 0).sum())
    counts = counts[counts > 0]
    if options.append_eod and len(counts):
        last = np.cumsum(counts) - 1  # the last sequence of each document gets the end-of-document token
        insert_at = np.cumsum(lengths)[last]
        ids = np.insert(ids, insert_at, np.asarray(tokenizer.eod, dtype=dtype))
        lengths[last] += 1
    return ids, lengths.astype(np.int32), counts, skipped


def _process(chunk: tuple) -> tuple:
    options: PreprocessOptions = _WORKER["options"]
    texts, lines, errors = read_chunk(chunk, options.json_keys)
    if errors:
        return ("error", errors[0], lines)
    results = [tokenize_texts(column, _WORKER["tokenizer"], options, _WORKER["dtype"]) for column in texts]
    return ("ok", results, lines)


# ---------------------------------------------------------------------- progress
class ProgressBar:
    """One line on stderr with the share done, tokens/s and the ETA: redrawn in place on a
    terminal, a new line every 10 s otherwise."""

    def __init__(self, total: float, unit: str, enabled: bool = True, stream: Any = None):
        self.total, self.unit, self.enabled = total, unit, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.last = self.start

    def line(self, done: float, documents: int, tokens: int) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        share = done / self.total if self.total else 1.0
        eta = elapsed / share - elapsed if share > 0 else float("nan")
        amount = f"{done / 2**20:.1f}/{self.total / 2**20:.1f} MB" if self.unit == "bytes" else f"{int(done):,}/{int(self.total):,} rows"
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?"
        return f"[{100 * share:5.1f}%] {amount} | {documents:,} docs | {tokens:,} tokens | {tokens / elapsed:,.0f} tokens/s | ETA {eta_text}"

    def update(self, done: float, documents: int, tokens: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last < (0.5 if self.tty else 10.0):
            return
        self.last = now
        text = self.line(done, documents, tokens)
        self.stream.write(f"\r{text}\x1b[K" if self.tty else text + "\n")
        self.stream.flush()

    def close(self, done: float, documents: int, tokens: int) -> None:
        self.update(done, documents, tokens, force=True)
        if self.enabled and self.tty:
            self.stream.write("\n")


# ---------------------------------------------------------------------- the run
def output_prefix(options: PreprocessOptions, key: str) -> str:
    level = "sentence" if options.split_sentences else "document"
    return f"{options.output_prefix}_{key}_{level}"


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""Write errors that mean the output's filesystem (or the user's quota, or file size limit) is full."""


class _Terminated(Exception):
    """SIGTERM arrived: stop and clean up as for Ctrl-C."""


def preprocess(options: PreprocessOptions) -> dict[str, KeyResult]:
    """Preprocess `options.input`; returns what was written per key."""
    if options.workers < 1:
        raise PreprocessError(f"--workers must be at least 1, got {options.workers}")
    if not options.json_keys:
        raise PreprocessError("--json-keys: give at least one key")
    repeated = sorted({key for key in options.json_keys if options.json_keys.count(key) > 1})
    if repeated:  # each key has one output: a repeated key would write its documents twice into it
        raise PreprocessError(f"--json-keys: {', '.join(map(repr, repeated))} given more than once (name each key once)")
    tokenizer = load_tokenizer(options)
    out_dir = os.path.dirname(os.path.abspath(options.output_prefix))
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise PreprocessError(f"--output-prefix: {out_dir!r} is not a directory (choose a prefix in a directory)")
    source = input_split(options.input, options.split)
    chunks = plan_chunks(source)
    # made (and a file written there) only once the input and tokenizer are known good
    unwritable = unwritable_reason(out_dir, create=True)
    if unwritable:
        raise PreprocessError(f"--output-prefix: {unwritable} (choose a prefix in a directory you can write)")
    dtype = token_dtype(tokenizer.vocab_size)
    writers: dict[str, IndexedDatasetWriter] = {}
    try:
        for key in options.json_keys:
            writers[key] = IndexedDatasetWriter(output_prefix(options, key), dtype)
    except OSError as exc:  # e.g. a prefix whose file names (with their temporary suffix) are too long
        for writer in writers.values():
            writer.abort()
        raise PreprocessError(
            f"--output-prefix: cannot create {exc.filename!r}: {exc.strerror} "
            "(choose a shorter prefix, in a directory you can write)"
        ) from None
    skipped = dict.fromkeys(options.json_keys, 0)
    unit = "rows" if source.dataset_dir or any(c[0] in ("parquet", "arrow") for c in chunks) else "bytes"
    bar = ProgressBar(sum(c[4] for c in chunks), unit, options.progress)
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if _in_main_thread() else None
    done = 0.0
    try:
        pool = worker_pool(options.workers, _init_worker, (options, False))
        try:
            pending: collections.deque = collections.deque()
            todo = iter(chunks)
            for chunk in itertools.islice(todo, 2 * options.workers):
                pending.append((chunk, pool.submit(_process, chunk)))
            while pending:
                chunk, job = pending.popleft()
                try:
                    status, payload, lines = job.result()
                except BrokenProcessPool:
                    raise PreprocessError(
                        f"a worker process died (killed, or out of memory) while reading {chunk[1]}; "
                        "try fewer --workers"
                    ) from None
                if status == "error":
                    raise PreprocessError(_locate(payload, chunk))
                for chunk_next in itertools.islice(todo, 1):
                    pending.append((chunk_next, pool.submit(_process, chunk_next)))
                for key, (ids, lengths, counts, empty) in zip(options.json_keys, payload):
                    writers[key].add_documents(ids, lengths, counts)
                    skipped[key] += empty
                done += chunk[4]
                first = writers[options.json_keys[0]]
                bar.update(done, first.documents, first.tokens)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        _refuse_keys_without_documents(options, writers, skipped)
        for writer in writers.values():
            writer.finalize()
    except BaseException as exc:
        for writer in writers.values():
            writer.abort()
        if isinstance(exc, OSError) and exc.errno in _FULL:
            raise PreprocessError(
                f"writing {options.output_prefix}_*.bin/.idx failed: {exc.strerror}; nothing was written under the "
                "output names (free space on that filesystem, or choose another --output-prefix)"
            ) from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    first = writers[options.json_keys[0]]
    bar.close(done, first.documents, first.tokens)
    return {key: KeyResult(w.prefix, w.documents, w.tokens, skipped[key]) for key, w in writers.items()}


def _refuse_keys_without_documents(options: PreprocessOptions, writers: dict, skipped: dict[str, int]) -> None:
    """An output without a document is no dataset megatron-core can draw from: refuse it before
    anything is written under the output names."""
    empty = [key for key, writer in writers.items() if writer.documents == 0]
    if not empty:
        return
    if not any(skipped.values()):
        raise PreprocessError(f"--input {options.input!r} holds no documents; nothing was written (give a non-empty input)")
    rows = skipped[empty[0]]  # every row was empty under these keys
    raise PreprocessError(
        f"--input {options.input!r}: {' and '.join(map(repr, empty))} empty in all {rows:,} rows (megatron-core's "
        "datasets need a document with tokens); nothing was written (choose --json-keys with text)"
    )


def _locate(message: str, chunk: tuple) -> str:
    """A worker's error with the absolute line number of the file (workers count lines from
    their chunk's start)."""
    match = re.match(r"line\+(\d+): (.*)", message, re.S)
    if match and chunk[0] == "lines":
        return f"{chunk[1]} line {lines_before_chunk(chunk) + int(match.group(1))}: {match.group(2)}"
    return message


def lines_before_chunk(chunk: tuple) -> int:
    """Lines of the chunk's file before the chunk: counted directly (errors are rare)."""
    kind, file, start, _, _ = chunk
    if start == 0:
        return 0
    count = 0
    with open(file, "rb") as f:
        remaining = start
        while remaining > 0:
            block = f.read(min(remaining, 1 << 20))
            if not block:
                break
            count += block.count(b"\n")
            remaining -= len(block)
        # a line that runs into this chunk belongs to the previous one
        f.seek(start - 1)
        if f.read(1) != b"\n":
            count += 1
    return count


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(f"terminated by signal {signum}")


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
