"""`evaluate()`: loss and perplexity of a model on a corpus, and multiple-choice accuracy.

The loss is the mean negative log-likelihood of the next token over every counted token of the
data (token-weighted: a long document counts more than a short one), in nats; the perplexity
is its exponential. Logits beyond the model's real vocabulary (padding rows) do not take part,
as in the Hugging Face model the weights export to. See `corpora` for what each format counts,
and `choices` for multiple choice (whose loss is that of the right choices' tokens).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_bridge.inference.corpora import CHOICE, FORMATS, INDEXED, SFT, TEXT, detect_format
from megatron_bridge.inference.errors import DataError
from megatron_bridge.inference.model import BACKENDS, InferenceModel, ModelLike, load_model
from megatron_bridge.config.errors import Problems
from megatron_bridge.inference import choices, corpora
from megatron_bridge.inference.source_tokenizer import load_tokenizer, require_tokenizer
from megatron_bridge.inference.sources import declared_seq_length, resolve
from megatron_bridge.runtime.tokenizers.tokenizer import NotTokenIdsError


@dataclass
class EvalResult:
    """What `evaluate()` measured."""

    loss: float
    """Mean next-token negative log-likelihood of the counted tokens (nats)."""

    tokens: int
    """How many tokens were counted."""

    format: str
    """The data's format: text, indexed, sft or choice."""

    sequences: int
    """Documents, windows, rows or (for multiple choice) items scored."""

    accuracy: Optional[float] = None
    """Multiple choice: the fraction of items whose right choice has the highest log-likelihood."""

    accuracy_norm: Optional[float] = None
    """Multiple choice: the same with log-likelihoods divided by the choice's length in characters."""

    predictions: list[int] = field(default_factory=list)
    """Multiple choice: the choice picked for each item."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else float("inf")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens}
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        return out


def evaluate(
    model: ModelLike,
    data: str,
    *,
    text_key: str = "text",
    seq_length: Optional[int] = None,
    concat: bool = False,
    data_format: Optional[str] = None,
    batch_size: int = 8,
    step: Optional[int] = None,
    base: Optional[str] = None,
    tokenizer: Optional[str] = None,
    tp: Optional[int] = None,
    dtype: Optional[str] = None,
    backend: str = "auto",
) -> EvalResult:
    """Evaluate `model` (a model source, or a loaded `InferenceModel`; `step`, `base`,
    `tokenizer`, `tp`, `dtype`, `backend` as for `load_model`) on the file `data`: JSONL text (field
    `text_key`), an indexed dataset prefix, fine-tuning JSONL, or multiple-choice JSONL (the
    format is detected unless `data_format` names it). Sequences are truncated to `seq_length`
    tokens (default: the model's); `concat` scores text as pretraining windows instead of one
    document at a time."""
    problems = Problems()
    problems.positive("batch_size", batch_size)
    problems.check(backend in BACKENDS, "backend", f"unknown process-group backend {backend!r}", f"use one of {list(BACKENDS)}")
    problems.check(seq_length is None or seq_length >= 2, "seq_length", f"must be 2 or more, got {seq_length}", "e.g. 2048")
    problems.check(data_format is None or data_format in FORMATS, "data_format", f"unknown format {data_format!r}", f"use one of {list(FORMATS)}")
    problems.raise_if_any()
    if isinstance(model, InferenceModel):
        fmt = _format(data, data_format, text_key, concat)
        length = _length(seq_length, model.seq_length)
        return _score(model, data, fmt, *_read(data, fmt, text_key, model.tokenizer, length, concat), batch_size)

    # The source and the data are read and checked before the model is built.
    source = resolve(os.fspath(model), step, base)
    fmt = _format(data, data_format, text_key, concat)
    tok = load_tokenizer(source, tokenizer)
    if fmt != INDEXED:
        require_tokenizer(tok, source, f"reading {fmt} data")
    sequences, items = _read(data, fmt, text_key, tok, _length(seq_length, declared_seq_length(source)), concat)
    with load_model(source, tokenizer=tokenizer, tp=tp, dtype=dtype, backend=backend, preloaded_tokenizer=tok) as loaded:
        return _score(loaded, data, fmt, sequences, items, batch_size)


def _format(data: str, data_format: Optional[str], text_key: str, concat: bool) -> str:
    fmt = data_format or detect_format(os.fspath(data), text_key)
    if concat and fmt not in (TEXT, INDEXED):
        raise DataError(f"--concat joins documents of text or indexed data, not {fmt} data")
    return fmt


def _length(requested: Optional[int], model_length: Optional[int]) -> int:
    if requested is None:
        return model_length or 4096
    if model_length is not None and requested > model_length:
        raise DataError(f"--seq-length {requested} is longer than the model's sequence length {model_length}")
    return requested


def _read(data: str, fmt: str, text_key: str, tok: Any, seq_length: int, concat: bool) -> tuple[list, Optional[list]]:
    """(scored sequences, multiple-choice items or None) of the data."""
    if tok is None and fmt != INDEXED:
        raise DataError(f"reading {fmt} data needs a tokenizer, and the model has none")
    try:
        return _tokenized(data, fmt, text_key, tok, seq_length, concat)
    except NotTokenIdsError as exc:
        raise DataError(f"{data}: {exc}") from None


def _tokenized(data: str, fmt: str, text_key: str, tok: Any, seq_length: int, concat: bool) -> tuple[list, Optional[list]]:
    if fmt == TEXT:
        return corpora.text_sequences(data, text_key, tok, seq_length, concat), None
    if fmt == INDEXED:
        return corpora.indexed_sequences(corpora.indexed_prefix(data) or data, seq_length, concat), None
    if fmt == SFT:
        return corpora.sft_sequences(data, tok, seq_length), None
    items = choices.read_items(data)
    return choices.choice_sequences(items, tok, seq_length), items


def _score(model: InferenceModel, data: str, fmt: str, sequences: list, items: Optional[list], batch_size: int) -> EvalResult:
    from megatron_bridge.inference.scoring import nll_total, token_logprobs

    largest = max((int(seq.ids.max()) for seq in sequences if len(seq.ids)), default=-1)
    if largest >= model.vocab_size:
        raise DataError(f"{data!r} holds token id {largest}, beyond the model's vocabulary of {model.vocab_size}")
    logprobs = token_logprobs(model, sequences, batch_size)
    if items is None:
        total, count = nll_total(sequences, logprobs)
        return EvalResult(_mean(total, count, data), count, fmt, len(sequences))
    picked = choices.pick(items, sequences, logprobs)
    starts = [0]
    for item in items[:-1]:
        starts.append(starts[-1] + len(item.choices))
    gold = [start + item.label for start, item in zip(starts, items)]
    total, count = nll_total([sequences[k] for k in gold], [logprobs[k] for k in gold])
    return EvalResult(_mean(total, count, data), count, CHOICE, len(items), picked.accuracy(items),
                      picked.accuracy_norm(items), picked.predictions)  # fmt: skip


def _mean(total: float, count: int, data: str) -> float:
    if count == 0:
        raise DataError(f"{data!r} has no token to score (each sequence needs two tokens or more)")
    return total / count
