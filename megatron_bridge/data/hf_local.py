"""Local datasets, offline: data files (json, jsonl, parquet, arrow), directories of them, and
directories written by `datasets` (`save_to_disk`), with split selection.

A split is named as in Hugging Face `datasets`, optionally with a row slice: `train`,
`validation`, `train[:90%]`, `train[90%:]`, `test[:1000]`. Files are assigned to splits by name
(`train*`, `validation*`/`valid*`/`val*`/`dev*`, `test*`; `training.jsonl` counts as train);
files that name no split are `train`. Nothing is downloaded: a name that is not a local path
(such as a Hub id) is an error that says how to make a local copy.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional

from megatron_bridge.extras import require
from megatron_bridge.runtime import json_input

SUFFIX_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
"""Data file suffixes and their formats."""

SPLIT_ALIASES = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing"),
}
"""Canonical split names and the file-name words that select them."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_SPLIT_SPEC = re.compile(r"\s*([\w.-]+)\s*(?:\[\s*([-+]?\d+%?)?\s*:\s*([-+]?\d+%?)?\s*\])?\s*")


class DataSourceError(ValueError):
    """A local dataset that cannot be read as asked: missing, malformed, or not local."""

    def __init__(self, message: str, fix: str = ""):
        super().__init__(f"{message} ({fix})" if fix else message)
        self.message = message
        self.fix = fix


def force_offline() -> None:
    """Keep `datasets` and `huggingface_hub` off the network, also when already imported."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import sys

    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_DATASETS_OFFLINE = True
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True


# ---------------------------------------------------------------------- split selection
@dataclass(frozen=True)
class SplitSpec:
    """A split name with an optional row slice, e.g. `train[:90%]`."""

    name: str
    start: Optional[str] = None
    stop: Optional[str] = None

    @classmethod
    def parse(cls, text: str) -> "SplitSpec":
        match = _SPLIT_SPEC.fullmatch(text)
        if not match:
            raise DataSourceError(f"split {text!r} is not a split name with an optional slice", "e.g. 'train', 'train[:90%]', 'test[:1000]'")
        return cls(match.group(1), match.group(2), match.group(3))

    def canonical_name(self) -> str:
        for name, aliases in SPLIT_ALIASES.items():
            if self.name in aliases:
                return name
        return self.name

    def bounds(self, total: int) -> tuple[int, int]:
        """Row range [start, stop) of a split of `total` rows."""

        def position(text: Optional[str], default: int) -> int:
            if text is None:
                return default
            value = int(round(float(text[:-1]) * total / 100)) if text.endswith("%") else int(text)
            if value < 0:
                value += total
            return min(max(value, 0), total)

        return position(self.start, 0), position(self.stop, total)

    def __str__(self) -> str:
        if self.start is None and self.stop is None:
            return self.name
        return f"{self.name}[{self.start or ''}:{self.stop or ''}]"


# ---------------------------------------------------------------------- one split
@dataclass(frozen=True)
class LocalSplit:
    """One split of a local dataset: data files, or a `datasets` directory, and a row range."""

    name: str
    files: tuple[str, ...] = ()
    dataset_dir: Optional[str] = None
    rows: Optional[tuple[int, int]] = None

    def describe(self) -> str:
        where = self.dataset_dir if self.dataset_dir else (self.files[0] if len(self.files) == 1 else f"{len(self.files)} files")
        return f"{where} [{self.name}]" if self.dataset_dir or self.rows else str(where)

    def identity(self) -> list[Any]:
        """What the content depends on: paths, sizes and modification times, and the rows."""
        paths = list(self.files) or _arrow_files(self.dataset_dir)
        return [[p, os.path.getsize(p), os.path.getmtime(p)] for p in paths] + [self.rows]

    # -- reading
    def hf_dataset(self) -> Any:
        force_offline()
        datasets = require("datasets", "reading a datasets directory (save_to_disk)")
        return datasets.load_from_disk(self.dataset_dir)

    def columns(self) -> list[str]:
        """Column names (for JSON files: the keys of the first record)."""
        if self.dataset_dir:
            return list(self.hf_dataset().column_names)
        file = self.files[0]
        kind = SUFFIX_FORMATS[os.path.splitext(file)[1]]
        if kind == "parquet":
            pq = require("pyarrow.parquet", "reading Parquet files")

            return list(pq.ParquetFile(file).schema_arrow.names)
        if kind == "arrow":
            return list(open_arrow(file).schema.names)
        for _, record in self.json_records(file, limit=1):
            return list(record)
        return []

    def num_rows(self) -> int:
        if self.rows is not None:
            return self.rows[1] - self.rows[0]
        return self._total_rows()

    def _total_rows(self) -> int:
        if self.dataset_dir:
            return len(self.hf_dataset())
        return sum(_count_rows(f) for f in self.files)

    def with_rows(self, spec: SplitSpec) -> "LocalSplit":
        if spec.start is None and spec.stop is None:
            return self
        return replace(self, name=str(spec), rows=spec.bounds(self._total_rows()))

    def records(self, columns: Optional[list[str]] = None) -> Iterator[tuple[str, dict]]:
        """(location, record) of every row in order; `location` names the file and line or row."""
        start, stop = self.rows if self.rows is not None else (0, None)
        index = 0
        for location, record in self._all_records(columns):
            if stop is not None and index >= stop:
                return
            if index >= start:
                yield location, record
            index += 1

    def _all_records(self, columns: Optional[list[str]]) -> Iterator[tuple[str, dict]]:
        if self.dataset_dir:
            ds = self.hf_dataset()
            if columns:
                ds = ds.select_columns([c for c in columns if c in ds.column_names])
            for row, record in enumerate(ds):
                yield f"{self.dataset_dir} row {row}", record
            return
        for file in self.files:
            kind = SUFFIX_FORMATS[os.path.splitext(file)[1]]
            if kind == "json":
                yield from self.json_records(file)
            else:
                batches = _parquet_batches(file, columns) if kind == "parquet" else _arrow_batches(file, columns)
                row = 0
                for batch in batches:
                    for record in batch.to_pylist():
                        yield f"{file} row {row}", record
                        row += 1

    @staticmethod
    def json_records(file: str, limit: Optional[int] = None) -> Iterator[tuple[str, dict]]:
        with open(file, "rb") as f:
            head = f.read(64).lstrip()
        if head.startswith(b"["):  # one JSON array of records (read as bytes: text that is not UTF-8 is malformed JSON)
            with open(file, "rb") as f:
                try:
                    items = json_input.load(f)
                except json.JSONDecodeError as exc:
                    raise DataSourceError(f"{file} line {exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno})") from None
            for i, record in enumerate(items[:limit] if limit else items):
                yield f"{file} item {i}", _as_record(record, f"{file} item {i}")
            return
        count = 0
        with open(file, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                location = f"{file} line {number}"
                try:
                    record = json_input.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataSourceError(f"{location}: not valid JSON ({exc.msg}, column {exc.colno})") from None
                yield location, _as_record(record, location)
                count += 1
                if limit is not None and count >= limit:
                    return


def _as_record(value: Any, location: str) -> dict:
    if not isinstance(value, dict):
        raise DataSourceError(f"{location}: expected a JSON object, got {type(value).__name__}")
    return value


def open_arrow(file: str) -> Any:
    pa = require("pyarrow", "reading Arrow files")

    source = pa.memory_map(file)
    try:
        return pa.ipc.open_stream(source)  # what `datasets` writes
    except pa.ArrowInvalid:
        return pa.ipc.open_file(source)


def _arrow_batches(file: str, columns: Optional[list[str]]) -> Iterator[Any]:
    reader = open_arrow(file)
    keep = [c for c in columns if c in reader.schema.names] if columns else None
    if hasattr(reader, "get_batch"):  # the random-access file format
        batches: Any = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = reader
    for batch in batches:
        yield batch.select(keep) if keep else batch


def _parquet_batches(file: str, columns: Optional[list[str]]) -> Iterator[Any]:
    pq = require("pyarrow.parquet", "reading Parquet files")

    pf = pq.ParquetFile(file)
    keep = [c for c in columns if c in pf.schema_arrow.names] if columns else None
    yield from pf.iter_batches(batch_size=1024, columns=keep)


def _count_rows(file: str) -> int:
    kind = SUFFIX_FORMATS[os.path.splitext(file)[1]]
    if kind == "parquet":
        pq = require("pyarrow.parquet", "reading Parquet files")

        return pq.ParquetFile(file).metadata.num_rows
    if kind == "arrow":
        return sum(b.num_rows for b in _arrow_batches(file, None))
    return sum(1 for _ in LocalSplit.json_records(file))


def _arrow_files(dataset_dir: Optional[str]) -> list[str]:
    if not dataset_dir:
        return []
    state = os.path.join(dataset_dir, "state.json")
    if os.path.isfile(state):
        with open(state) as f:
            return [os.path.join(dataset_dir, d["filename"]) for d in json.load(f).get("_data_files", [])]
    return []


# ---------------------------------------------------------------------- a dataset root
def _is_saved_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json"))


def _split_of_file(path: str) -> Optional[str]:
    words = re.split(r"[^a-z0-9]+", os.path.basename(path).lower())
    for name, aliases in SPLIT_ALIASES.items():
        if any(w in aliases for w in words):
            return name
    return None


def data_files(directory: str) -> list[str]:
    """Data files of a directory (and of its `data/` subdirectory, the Hub layout), sorted."""
    found = []
    for where in (directory, os.path.join(directory, "data")):
        if os.path.isdir(where):
            found += [os.path.join(where, n) for n in sorted(os.listdir(where)) if os.path.splitext(n)[1] in SUFFIX_FORMATS]
    return [f for f in found if os.path.isfile(f)]


def open_local(root: str) -> dict[str, LocalSplit]:
    """The splits of a local dataset at `root`, by canonical name (train/validation/test or the
    names a DatasetDict uses). Raises DataSourceError when `root` is not a readable local dataset."""
    root = os.fspath(root)
    if not os.path.exists(root):
        if _HUB_ID.fullmatch(root) and not root.endswith(tuple(SUFFIX_FORMATS)):
            raise DataSourceError(
                f"{root!r} is not a local path; datasets are read from local files only, and a Hub id is not downloaded",
                f"make a local copy where there is network (datasets.load_dataset({root!r}).save_to_disk(DIR)) and use DIR",
            )
        raise DataSourceError(f"{root!r} does not exist")
    if os.path.isfile(root):
        if os.path.splitext(root)[1] not in SUFFIX_FORMATS:
            raise DataSourceError(f"{root!r} is not a data file", f"use one of {sorted(SUFFIX_FORMATS)}")
        return {"train": LocalSplit("train", files=(root,))}
    dict_file = os.path.join(root, "dataset_dict.json")
    if os.path.isfile(dict_file):
        with open(dict_file) as f:
            names = json.load(f).get("splits", [])
        return {_canonical(n): LocalSplit(n, dataset_dir=os.path.join(root, n)) for n in names}
    if _is_saved_dataset(root):
        return {"train": LocalSplit("train", dataset_dir=root)}
    files = data_files(root)
    if not files:
        raise DataSourceError(
            f"{root!r} has no data files and is not a datasets directory",
            f"put {', '.join(sorted(SUFFIX_FORMATS))} files in it, or point at a directory written by save_to_disk",
        )
    groups: dict[str, list[str]] = {}
    for f in files:
        groups.setdefault(_split_of_file(f) or "train", []).append(f)
    return {name: LocalSplit(name, files=tuple(fs)) for name, fs in groups.items()}


def _canonical(name: str) -> str:
    return SplitSpec(name).canonical_name()


def select_split(root: str, spec_text: str) -> Optional[LocalSplit]:
    """The split `spec_text` (e.g. 'train[:90%]') of the dataset at `root`; None if it has no
    split of that name."""
    spec = SplitSpec.parse(spec_text)
    splits = open_local(root)
    split = splits.get(spec.name) or splits.get(spec.canonical_name())
    return None if split is None else split.with_rows(spec)
