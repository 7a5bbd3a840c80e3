"""Fine-tuning records: where each split comes from, which format its rows have, what is wrong
with a row, and how a row becomes token ids with the flags of the tokens the loss covers.

Two formats:
- prompt/answer: `{"input": ..., "output": ...}`; the loss covers the answer and the closing
  end-of-document token;
- chat: `{"messages": [{"role": ..., "content": ...}, ...]}`, rendered with the chat template;
  the loss covers the assistant turns.

Column names are mapped with `dataset.column_mapping` (e.g. `{input: question, output: answer}`),
or the older `dataset_kwargs={prompt_key, answer_key}`. This module does no tokenizer or torch
import of its own, so checks can use it on a machine without the training stack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from megatron_bridge.data.hf_local import DataSourceError, LocalSplit, SplitSpec, open_local, select_split

SPLITS = ("train", "valid", "test")
"""The splits of a fine-tuning run."""

DEFAULT_SPLIT_NAMES = {"train": "train", "valid": "validation", "test": "test"}
"""Which split of the data each run split reads, unless `dataset.splits` says otherwise."""

COLUMN_ROLES = ("input", "output", "messages")
"""What `dataset.column_mapping` may map."""

PROMPT, CHAT = "prompt/answer", "chat"


@dataclass(frozen=True)
class RecordFormat:
    """The format of a split's rows and the columns that hold each part."""

    kind: str
    prompt: str = "input"
    answer: str = "output"
    messages: str = "messages"

    def columns(self) -> list[str]:
        return [self.messages] if self.kind == CHAT else [self.prompt, self.answer]


def column_mapping(data: Any) -> dict[str, str]:
    """The configured column mapping (`column_mapping`, else `dataset_kwargs` prompt/answer keys)."""
    mapping = dict(data.column_mapping or {})
    kwargs = data.dataset_kwargs or {}
    if "prompt_key" in kwargs:
        mapping.setdefault("input", kwargs["prompt_key"])
    if "answer_key" in kwargs:
        mapping.setdefault("output", kwargs["answer_key"])
    return mapping


def detect_format(columns: list[str], mapping: dict[str, str], where: str) -> RecordFormat:
    """The format of rows with `columns`; raises DataSourceError naming a column that is missing."""
    prompt, answer, messages = (mapping.get(r, r) for r in COLUMN_ROLES)
    if "messages" in mapping or ("input" not in mapping and "output" not in mapping and messages in columns):
        if messages not in columns:
            raise DataSourceError(
                f"{where}: no column {messages!r} (dataset.column_mapping.messages); its columns are {columns}",
                "map the column that holds the conversations: dataset.column_mapping={messages: NAME}",
            )
        return RecordFormat(CHAT, messages=messages)
    missing = [(role, name) for role, name in (("input", prompt), ("output", answer)) if name not in columns]
    if missing:
        named = ", ".join(f"{name!r} ({role})" for role, name in missing)
        raise DataSourceError(
            f"{where}: unknown column {named}; its columns are {columns}",
            "use 'input'/'output' or 'messages' columns, or map yours: dataset.column_mapping={input: NAME, output: NAME}",
        )
    return RecordFormat(PROMPT, prompt=prompt, answer=answer)


def split_sources(data: Any) -> dict[str, Optional[LocalSplit]]:
    """The data each run split reads (None where the data has no such split); raises
    DataSourceError when `dataset_root` cannot be read or has no training split."""
    root = os.fspath(data.dataset_root)
    wanted = {**DEFAULT_SPLIT_NAMES, **(data.splits or {})}
    available = open_local(root)
    sources = {}
    for split in SPLITS:
        sources[split] = select_split(root, wanted[split])
    if sources["train"] is None:
        raise DataSourceError(
            f"{root!r} has no {wanted['train']!r} split (it has {sorted(available)})",
            "add training.jsonl (or train.* files), or choose one with dataset.splits={train: NAME}",
        )
    return sources


# ---------------------------------------------------------------------- one row
TOKENIZER_TYPE = "tokenizer.tokenizer_type"
DATASET_ROOT = "dataset.dataset_root"


def record_problem(record: dict, fmt: RecordFormat, location: str, null_vocab: Optional[int]) -> Optional[tuple[str, str]]:
    """(config path, message) of what is wrong with one row, or None. `null_vocab`: the
    vocabulary of a NullTokenizer, whose rows must hold token ids."""
    from megatron_bridge.data.chat import check_messages

    if fmt.kind == CHAT:
        problem = check_messages(record.get(fmt.messages), location)
        return (DATASET_ROOT, problem) if problem else None
    for column in (fmt.prompt, fmt.answer):
        if column not in record:
            return DATASET_ROOT, f"{location}: no {column!r} field"
        value = record[column]
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            return DATASET_ROOT, f"{location}: {column!r} is {type(value).__name__}, not text"
        if null_vocab is not None:
            bad = _non_token_id(str(value), null_vocab)
            if bad is not None:
                return TOKENIZER_TYPE, (
                    f"NullTokenizer reads space-separated token ids below {null_vocab}, but {location} has "
                    f"{bad} in {column!r}"
                )
    return None


def _non_token_id(text: str, vocab: int) -> Optional[str]:
    for word in text.split():
        if not word.isdigit() or int(word) >= vocab:
            return repr(word if len(text) > 40 else text)
    return None


def first_problem(source: LocalSplit, fmt: RecordFormat, null_vocab: Optional[int]) -> Optional[tuple[str, str]]:
    """(config path, message) of the first bad row of `source` (reading errors included)."""
    try:
        for location, record in source.records(fmt.columns()):
            problem = record_problem(record, fmt, location, null_vocab)
            if problem:
                return problem
    except DataSourceError as exc:
        return DATASET_ROOT, str(exc)
    return None


def check_sft_options(data: Any, problems: Any) -> None:
    """`splits` and `column_mapping` of a FinetuningDatasetConfig (no file access)."""
    for key, value in (data.splits or {}).items():
        if not problems.check(key in SPLITS, f"splits.{key}", f"unknown run split {key!r}", f"use {list(SPLITS)}"):
            continue
        try:
            SplitSpec.parse(value)
        except DataSourceError as exc:
            problems.add(f"splits.{key}", exc.message, exc.fix)
    mapping = data.column_mapping or {}
    for key, value in mapping.items():
        problems.check(key in COLUMN_ROLES, f"column_mapping.{key}", f"unknown role {key!r}", f"map {list(COLUMN_ROLES)} to your column names")
        problems.check(isinstance(value, str) and bool(value), f"column_mapping.{key}", f"must be a column name, got {value!r}", "e.g. question")
    if "messages" in mapping and ({"input", "output"} & set(mapping)):
        problems.add("column_mapping", "maps both messages and input/output", "a split is either chat (messages) or prompt/answer (input, output)")
