"""Data checks before the model is built: the tokenizer loads and fits the model's vocabulary,
every indexed-dataset prefix has a readable, consistent `.bin`/`.idx` pair whose token ids fit
the tokenizer, and the fine-tuning data parses (the first bad row named).

`setup()` runs them on every rank before building the model; a problem is a
`ConfigValidationError`. A dry run (planning on a machine without the data, such as a login
node) runs them too, but data that is absent is only noted as "not found on this machine".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import numpy as np

from megatron_bridge.config.errors import ConfigValidationError, Problems
from megatron_bridge.config.paths import file_kind
from megatron_bridge.config.secrets import scrub
from megatron_bridge.data.builders import sample_counts
from megatron_bridge.data.chat import ChatFormatError, ChatRenderer
from megatron_bridge.data.config import FinetuningDatasetConfig, GPTDatasetConfig
from megatron_bridge.data import file_limit
from megatron_bridge.data.hf_local import DataSourceError
from megatron_bridge.data.indexed import check_index_arrays, largest_token_id, read_index_header, sequence_tokens
from megatron_bridge.data.sft_records import CHAT, column_mapping, detect_format, first_problem, split_sources
from megatron_bridge.runtime.tokenizers.config import SENTENCEPIECE_TYPES
from megatron_bridge.runtime.tokenizers.tokenizer import build_tokenizer

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer

NOT_FOUND = "not found on this machine"


@dataclass
class DataReport:
    """What the checks found: problems, and (on a dry run) the data absent from this machine."""

    problems: Problems = field(default_factory=Problems)
    not_found: list[str] = field(default_factory=list)

    def missing(self, path: str, what: str, dry_run: bool, fix: str) -> None:
        if dry_run:
            self.not_found.append(f"{path}: {what}: {NOT_FOUND}")
        else:
            self.problems.add(path, f"{what} does not exist", fix)


def build_checked_tokenizer(cfg: "ConfigContainer") -> Any:
    """`build_tokenizer(cfg.tokenizer)`, its failures reported as config problems."""
    report = DataReport()
    tokenizer = _tokenizer(cfg, report, dry_run=False)
    report.problems.raise_if_any()
    return tokenizer


_TOKENIZER_FILES = {
    "HuggingFaceTokenizer": (("tokenizer_model", "point it at a local tokenizer directory or tokenizer.json"),),
    "GPT2BPETokenizer": (
        ("vocab_file", "point it at the local vocab.json of GPT-2's BPE"),
        ("merge_file", "point it at the local merges.txt of GPT-2's BPE"),
    ),
    **{kind: (("tokenizer_model", "point it at the local SentencePiece tokenizer.model"),) for kind in SENTENCEPIECE_TYPES},
}
"""The files each tokenizer type reads, by config field, and the fix when one is missing."""


def _tokenizer(cfg: "ConfigContainer", report: DataReport, dry_run: bool) -> Optional[Any]:
    tok = cfg.tokenizer
    files = _TOKENIZER_FILES.get(tok.tokenizer_type, ())
    absent = [(name, fix) for name, fix in files if getattr(tok, name) and not os.path.exists(getattr(tok, name))]
    for name, fix in absent:
        report.missing(f"tokenizer.{name}", repr(getattr(tok, name)), dry_run, fix)
    if absent:
        return None
    try:
        return build_tokenizer(tok)
    except ModuleNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        # the tokenizers' messages start with the field at fault ("tokenizer.vocab_file: ...")
        text = str(exc)
        where = next((f"tokenizer.{n}" for n, _ in files if text.startswith(f"tokenizer.{n}: ")), None)
        where = where or f"tokenizer.{files[0][0] if files else 'tokenizer_type'}"
        fix = {
            "GPT2BPETokenizer": "use the BPE's own vocab.json and merges.txt",
            **dict.fromkeys(SENTENCEPIECE_TYPES, "use the SentencePiece model file (tokenizer.model) the model was trained with"),
        }.get(tok.tokenizer_type, "use a tokenizer that loads from local files")
        report.problems.add(where, text.removeprefix(f"{where}: "), fix)
        return None


def check_data(cfg: "ConfigContainer", tokenizer: Any = None, dry_run: bool = False) -> DataReport:
    """Run every data check of `cfg` (a resolved config); builds the tokenizer when not given."""
    report = DataReport()
    if tokenizer is None:
        tokenizer = _tokenizer(cfg, report, dry_run)
    if tokenizer is not None:
        check_vocab_fits(cfg, tokenizer, report.problems)
    data = cfg.dataset
    if isinstance(data, GPTDatasetConfig) and not data.mock:
        needed = needed_splits(cfg)
        _check_training_split(cfg, report.problems)
        for path, prefix in data_prefixes(data):
            check_indexed_prefix(prefix, path, tokenizer, report, dry_run, needed.get(path, ()))
    if isinstance(data, FinetuningDatasetConfig) and data.dataset_root is not None:
        check_finetuning_data(cfg, tokenizer, report, dry_run)
    return report


def check_before_build(cfg: "ConfigContainer", tokenizer: Any) -> None:
    """`check_data` for a real run, with room made for the files its datasets keep open: raise
    every problem at once."""
    report = check_data(cfg, tokenizer)
    file_limit.make_room_for_data_files(files_needed(cfg), report.problems)
    report.problems.raise_if_any()


def check_vocab_fits(cfg: "ConfigContainer", tokenizer: Any, problems: Problems) -> None:
    vocab = getattr(tokenizer, "vocab_size", None)
    model_vocab = cfg.model.vocab_size
    if vocab is None or model_vocab is None:
        return
    problems.check(
        vocab <= model_vocab,
        "model.vocab_size",
        f"{model_vocab} is smaller than the tokenizer's vocabulary of {vocab} (token ids up to {vocab - 1} would index past the embedding)",
        f"set model.vocab_size to at least {vocab}, or leave it unset to take the tokenizer's",
    )


# ---------------------------------------------------------------------- indexed datasets
def data_prefixes(data: Any) -> list[tuple[str, str]]:
    """(config path, prefix) of every indexed dataset the config names."""
    found = []
    source = "dataset.data_path" if data.data_path is not None else "dataset.blend"
    if data.blend is not None:
        found += [(source, p) for p in data.blend[0]]
    for split, blend in zip(("train", "valid", "test"), data.blend_per_split or []):
        if blend is not None:
            found += [(f"dataset.blend_per_split.{split}", p) for p in blend[0]]
    return found


def _check_training_split(cfg: "ConfigContainer", p: Problems) -> None:
    """A run that trains gets a training split: `dataset.split` gives it a share, or
    `blend_per_split` a blend (else no training set is built, found only after the model)."""
    data = cfg.dataset
    if cfg.validation.skip_train or sample_counts(cfg).train == 0:
        return
    if data.blend is not None and data.split is not None and not (getattr(data, "split_matrix", None) or [None])[0]:
        t = cfg.train  # name the setting the user gave: train_iters is derived from train_samples
        asked = f"train.train_samples={t.train_samples}" if t.train_samples is not None else f"train.train_iters={t.train_iters}"
        p.add("dataset.split", f"{data.split!r} gives the train split no share, but {asked} asks for training",
              "give the train split a share, e.g. dataset.split='99,1,0' (or set validation.skip_train=true to only evaluate)")  # fmt: skip
    elif data.blend is None and data.blend_per_split is not None and data.blend_per_split[0] is None:
        p.add("dataset.blend_per_split", "has no train blend (its first entry is null), but the run trains",
              "give the first entry the training data (or set validation.skip_train=true to only evaluate)")  # fmt: skip


class SplitShare(NamedTuple):
    """A split the run draws samples from, and the share of a prefix's sequences it reads."""

    name: str
    low: float
    high: float
    setting: Optional[str]
    """The `dataset.split` weighting the share comes from; None: the prefix is the split's own."""


def needed_splits(cfg: "ConfigContainer") -> dict[str, tuple[SplitShare, ...]]:
    """By config path of the prefixes (as `data_prefixes` names them): the splits the run draws
    samples from, with their share of each prefix (megatron-core's split matrix for a blend, the
    whole prefix in `blend_per_split`)."""
    counts = sample_counts(cfg)
    wanted = {"train": counts.train > 0, "valid": counts.valid > 0, "test": counts.test > 0}
    data = cfg.dataset
    source = "dataset.data_path" if data.data_path is not None else "dataset.blend"
    matrix = getattr(data, "split_matrix", None) or ()
    needed = {source: tuple(SplitShare(n, s[0], s[1], data.split) for n, s in zip(wanted, matrix) if s is not None and wanted[n])}
    for name in wanted:
        needed[f"dataset.blend_per_split.{name}"] = (SplitShare(name, 0.0, 1.0, None),) if wanted[name] else ()
    return needed


def files_needed(cfg: "ConfigContainer") -> dict[str, tuple[int, int]]:
    """By config path (`dataset.data_path`, `dataset.blend_per_split.valid`, ...): its number of
    prefixes and the files their datasets keep open (a prefix named twice counts twice)."""
    if not isinstance(cfg.dataset, GPTDatasetConfig) or cfg.dataset.mock:
        return {}
    needed = needed_splits(cfg)
    found: dict[str, tuple[int, int]] = {}
    for path, _ in data_prefixes(cfg.dataset):
        prefixes, files = found.get(path, (0, 0))
        found[path] = (prefixes + 1, files + file_limit.FILES_PER_PREFIX + file_limit.FILES_PER_SPLIT * len(needed.get(path, ())))
    return found


def check_indexed_prefix(
    prefix: str, path: str, tokenizer: Any, report: DataReport, dry_run: bool, splits: tuple[SplitShare, ...] = ()
) -> None:
    p = report.problems
    have = {suffix: os.path.isfile(prefix + suffix) for suffix in (".bin", ".idx")}
    odd = next((prefix + s for s, regular in have.items() if not regular and os.path.lexists(prefix + s)), None)
    if odd is not None:  # a directory, a pipe or a broken link there would otherwise read as "does not exist"
        p.add(path, f"{odd} is {file_kind(odd)}, not a regular file", "point the prefix at a .bin/.idx pair of files")
        return
    if not any(have.values()) and os.path.isdir(prefix):
        inside = _prefixes_in(prefix)
        hint = f"the prefixes in it are {', '.join(inside)}" if inside else "it holds no .bin/.idx pairs"
        p.add(path, f"{prefix} is a directory, not a prefix (a prefix is the path of a .bin/.idx pair without the suffix)", hint)
        return
    if not any(have.values()):
        report.missing(path, f"{prefix}.bin/.idx", dry_run, "run `mbridge data preprocess` to make it, or fix the prefix (the path without .bin/.idx)")
        return
    for suffix, other in ((".idx", ".bin"), (".bin", ".idx")):
        if not have[suffix]:
            p.add(path, f"{prefix}{other} exists but {prefix}{suffix} does not", "an interrupted or partial copy? preprocess or copy the pair again")
            return
    try:
        header = read_index_header(prefix)
        with open(prefix + ".bin", "rb") as f:
            f.read(1)
    except OSError as exc:
        p.add(path, f"cannot read {prefix}: {exc.strerror} ({exc.filename})", "check the file permissions")
        return
    except ValueError as exc:
        p.add(path, str(exc), "preprocess the data again")
        return
    if not np.issubdtype(header.dtype, np.integer):
        p.add(path, f"{prefix} stores {np.dtype(header.dtype).name} values, not token ids", "point the prefix at a token dataset (`mbridge data preprocess` writes one)")
        return
    size = os.path.getsize(prefix + ".bin")
    if size != header.bin_bytes:
        p.add(path, f"{prefix}.bin has {size:,} bytes but its .idx describes {header.bin_bytes:,}", "the two files come from different runs or a copy was cut short; preprocess again")
        return
    try:
        check_index_arrays(prefix, header)
    except ValueError as exc:
        p.add(path, str(exc), "the index is damaged or was not written by megatron-core's writer; preprocess the data again")
        return
    _check_splits_have_tokens(prefix, path, header, splits, p)
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is None:
        return
    limit = int(np.iinfo(header.dtype).max) + 1
    if vocab > limit:
        p.add(path, f"{prefix} stores {np.dtype(header.dtype).name} token ids (at most {limit:,} ids) but the tokenizer has {vocab:,}", "it was made with a smaller vocabulary: preprocess with this tokenizer")
        return
    largest = largest_token_id(prefix, header.dtype)
    p.check(
        largest < vocab,
        path,
        f"{prefix} holds token id {largest:,}, outside the tokenizer's vocabulary of {vocab:,}",
        "it was made with another tokenizer: preprocess with this one (or use the tokenizer it was made with)",
    )


def _prefixes_in(directory: str, shown: int = 4) -> list[str]:
    """The first `shown` prefixes of .bin/.idx pairs in `directory` (and '...' if there are more)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    pairs = [os.path.join(directory, n[: -len(".idx")]) for n in names if n.endswith(".idx") and n[: -len(".idx")] + ".bin" in names]
    return pairs[:shown] + (["..."] if len(pairs) > shown else [])


def _check_splits_have_tokens(prefix: str, path: str, header: Any, splits: tuple[SplitShare, ...], p: Problems) -> None:
    """Each split the run draws from gets tokens of `prefix`: megatron-core repeats a split's
    epochs until it has the samples asked for, which never ends on an empty split."""
    unit = "documents" if header.sequences == header.documents else "sequences"
    empty = []
    for share in splits:
        begin, end = int(round(share.low * header.sequences)), int(round(share.high * header.sequences))
        if sequence_tokens(prefix, header, begin, end) == 0:
            empty.append((share, end - begin))
    for share, count in empty:
        skip = {"valid": "; no validation: validation.eval_iters=0", "test": "; no test: validation.test_iters=0"}.get(share.name, "")
        if share.setting is None:
            p.add(path, f"{prefix} has no tokens (its {header.sequences:,} {unit} are empty)", f"give the {share.name} split a prefix with data{skip}")
            continue
        got = f"{count} of the {header.sequences:,} {unit}" + (", all empty," if count else "")
        p.add(
            "dataset.split",
            f"{share.setting!r} gives the {share.name} split {got} of {prefix}",
            f"give the {share.name} split a larger share (e.g. dataset.split='90,10,0') or use more data{skip}",
        )


# ---------------------------------------------------------------------- fine-tuning data
def check_finetuning_data(cfg: "ConfigContainer", tokenizer: Any, report: DataReport, dry_run: bool) -> None:
    data, p = cfg.dataset, report.problems
    root = os.fspath(data.dataset_root)
    if dry_run and not os.path.exists(root):
        report.missing("dataset.dataset_root", repr(root), dry_run, "")
        return
    try:
        sources = split_sources(data)
    except DataSourceError as exc:
        p.add("dataset.dataset_root", exc.message, exc.fix)
        return
    null_vocab = cfg.tokenizer.vocab_size if cfg.tokenizer.tokenizer_type == "NullTokenizer" else None
    mapping = column_mapping(data)
    for split, source in sources.items():
        if source is None or (split == "valid" and not data.do_validation) or (split == "test" and not data.do_test):
            continue
        try:
            fmt = detect_format(source.columns(), mapping, source.describe())
        except DataSourceError as exc:
            p.add("dataset.column_mapping" if mapping else "dataset.dataset_root", exc.message, exc.fix)
            continue
        if fmt.kind == CHAT:
            if null_vocab is not None:
                p.add("tokenizer.tokenizer_type", f"chat data ({source.describe()}) needs a tokenizer with a chat template, not a NullTokenizer", "use a HuggingFaceTokenizer (tokenizer.tokenizer_model=DIR)")
                continue
            if tokenizer is not None:
                try:
                    renderer = ChatRenderer(tokenizer)
                except ChatFormatError as exc:
                    p.add("tokenizer.chat_template", str(exc), "set tokenizer.chat_template, or use a tokenizer whose files have one")
                    continue
        problem = first_problem(source, fmt, null_vocab)
        if problem is None and fmt.kind == CHAT and tokenizer is not None:
            problem = first_row_rendering_problem(source, fmt, renderer)
        if problem is not None:
            where, message = problem
            fix = {
                "tokenizer.tokenizer_type": "use a HuggingFaceTokenizer (tokenizer.tokenizer_model=DIR) for text, or write token ids",
                "tokenizer.chat_template": "set tokenizer.chat_template to a template that renders this conversation",
            }.get(where, "fix or remove that row")
            p.add(where, message, fix)


def first_row_rendering_problem(source: Any, fmt: Any, renderer: Any) -> Optional[tuple[str, str]]:
    """(config path, message) when the chat template cannot render the first conversation with its
    assistant turns located: a template the whole split would fail on, found before the build."""
    try:
        for location, record in source.records(fmt.columns()):
            renderer.assistant_spans(record[fmt.messages])
            return None
    except ChatFormatError as exc:
        return "tokenizer.chat_template", f"{location}: {exc}"
    except DataSourceError:
        return None  # reported by the row checks
    return None


def dry_run_lines(cfg: "ConfigContainer") -> tuple[list[str], Optional[ConfigValidationError]]:
    """For `--dry-run`: the lines to print about the data, and the error of data problems (None
    when there are none)."""
    report = check_data(cfg, dry_run=True)
    lines = [scrub(line) for line in report.not_found] or ["all found and readable"]  # paths may come from the environment
    error = ConfigValidationError(report.problems.items) if report.problems.items else None
    return lines, error
