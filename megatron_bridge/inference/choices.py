"""Multiple choice by log-likelihood, as the common evaluation harnesses score it.

Each item is `{"context": str, "choices": [str, ...], "label": int}`. A choice is scored by the
log-likelihood of its tokens after the context: `context + choice` is encoded as a whole and the
choice's tokens are those after the context's own encoding (whitespace at the end of the context
moves to the choice first, so both encode as in running text). Encodings add no special tokens;
an empty context starts from the end-of-document token. Too long a pair loses context tokens
from the left.

The model picks the choice with the highest summed log-likelihood (`accuracy`, the harnesses'
`acc`); `accuracy_norm` divides each by the choice's length in characters (their `acc_norm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from megatron_bridge.inference.corpora import Scored, jsonl_rows
from megatron_bridge.inference.errors import DataError


@dataclass
class ChoiceItem:
    context: str
    choices: list[str]
    label: int


def read_items(path: str) -> list[ChoiceItem]:
    items = []
    for where, row in jsonl_rows(path):
        context, choices, label = row.get("context"), row.get("choices"), row.get("label")
        if not isinstance(context, str):
            raise DataError(f"{where}: 'context' must be a string, found {type(context).__name__}")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise DataError(f"{where}: 'choices' must be a list of two or more non-empty strings")
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
            raise DataError(f"{where}: 'label' must be the index of the right choice (0 to {len(choices) - 1}), found {label!r}")
        items.append(ChoiceItem(context, choices, label))
    if not items:
        raise DataError(f"--data {path!r} holds no items")
    return items


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.tokenize(context + continuation)
    if not context:
        return [tokenizer.eod], whole
    head = tokenizer.tokenize(context)
    return head, whole[len(head) :]


def choice_sequences(items: Sequence[ChoiceItem], tokenizer: Any, seq_length: int) -> list[Scored]:
    """One scored sequence per (item, choice), in order: the choice's tokens count."""
    out = []
    for item in items:
        for choice in item.choices:
            head, tail = encode_pair(tokenizer, item.context, choice)
            if not tail:
                raise DataError(f"choice {choice!r} encodes to no tokens after its context")
            ids = (head + tail)[-(seq_length + 1) :]
            weights = np.zeros(len(ids), dtype=np.float64)
            weights[len(ids) - len(tail) :] = 1.0
            weights[0] = 0.0
            out.append(Scored(np.asarray(ids, dtype=np.int64), weights))
    return out


@dataclass
class ChoiceResult:
    predictions: list[int]
    """The choice picked for each item (highest summed log-likelihood)."""

    predictions_norm: list[int]
    """The choice picked with log-likelihoods divided by the choice's length in characters."""

    loglikelihoods: list[list[float]]
    """Summed log-likelihood of every choice of every item."""

    def accuracy(self, items: Sequence[ChoiceItem]) -> float:
        return float(np.mean([p == it.label for p, it in zip(self.predictions, items)]))

    def accuracy_norm(self, items: Sequence[ChoiceItem]) -> float:
        return float(np.mean([p == it.label for p, it in zip(self.predictions_norm, items)]))


def pick(items: Sequence[ChoiceItem], sequences: Sequence[Scored], logprobs: Sequence[np.ndarray]) -> ChoiceResult:
    lls, preds, preds_norm = [], [], []
    k = 0
    for item in items:
        scores = []
        for _ in item.choices:
            scores.append(float(np.dot(sequences[k].weights[1:], logprobs[k])))
            k += 1
        lengths = np.asarray([len(c) for c in item.choices], dtype=np.float64)
        lls.append(scores)
        preds.append(int(np.argmax(scores)))
        preds_norm.append(int(np.argmax(np.asarray(scores) / lengths)))
    return ChoiceResult(preds, preds_norm, lls)
