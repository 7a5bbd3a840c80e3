"""`generate()`: text from a model, greedy or sampled, in batches, with a key/value cache.

Prompts are sorted by length and decoded in batches (padded on the left, see `kv_cache`). A
prompt's generation ends at a stop token (end of sequence, or an end-of-turn token the model's
generation_config.json lists), at a stop string, after `max_new_tokens`, or where the model's
sequence length is full. Its `text` ends before the stop string or stop token; its `token_ids`
are every new token, the final stop token included.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from megatron_bridge.inference.model import BACKENDS, InferenceModel, ModelLike, load_model
from megatron_bridge.inference.errors import PromptError
from megatron_bridge.inference.prompts import Prompt, encode_prompts
from megatron_bridge.inference.sampling import Sampling
from megatron_bridge.config.errors import Problems
from megatron_bridge.inference.source_tokenizer import load_tokenizer, require_tokenizer
from megatron_bridge.inference.sources import declared_seq_length, resolve

EOS, STOP, LENGTH = "eos", "stop", "length"


@dataclass
class Generation:
    """What the model wrote for one prompt."""

    prompt: Prompt
    """The prompt as given (a string or a list of messages)."""

    text: str
    """The new text (without the stop string or stop token that ended it)."""

    token_ids: list[int]
    """The new tokens only."""

    finish_reason: str
    """`eos` (a stop token), `stop` (a stop string), or `length` (max_new_tokens, or the
    model's sequence length)."""

    prompt_token_ids: list[int]
    """The tokens the prompt was encoded to."""

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason}


class Generations(list):
    """The generations of `generate()`, in the order of the prompts, with the time they took."""

    seconds: float = 0.0
    """Time spent generating (the model's loading excluded)."""

    @property
    def new_tokens(self) -> int:
        return sum(len(g.token_ids) for g in self)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def generate(
    model: ModelLike,
    prompts: Union[Prompt, Sequence[Prompt]],
    *,
    max_new_tokens: int = 64,
    temperature: Optional[float] = None,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: Sequence[str] = (),
    chat: bool = False,
    ignore_eos: bool = False,
    batch_size: int = 16,
    step: Optional[int] = None,
    base: Optional[str] = None,
    tokenizer: Optional[str] = None,
    tp: Optional[int] = None,
    dtype: Optional[str] = None,
    backend: str = "auto",
) -> Generations:
    """Generate text for each prompt with `model`: a model source (Hugging Face directory, or a
    checkpoint directory of ours; `step`, `base`, `tokenizer`, `tp`, `dtype` and
    `backend` as for `load_model`) or a loaded `InferenceModel`.

    Greedy unless `temperature` > 0 or `top_k`/`top_p` are given (see `Sampling`); `chat`
    renders plain prompts as a user message with the tokenizer's chat template; `stop` strings
    end a generation where they appear; `ignore_eos` generates past stop tokens."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    sampling = Sampling(temperature, top_k, top_p, seed).check()
    problems = Problems()
    problems.check(len(prompts) > 0, "prompts", "no prompt given", "give one or more prompts")
    problems.positive("max_new_tokens", max_new_tokens)
    problems.positive("batch_size", batch_size)
    problems.check(backend in BACKENDS, "backend", f"unknown process-group backend {backend!r}", f"use one of {list(BACKENDS)}")
    problems.check(all(isinstance(s, str) and s for s in stop), "stop", f"stop strings must be non-empty, got {list(stop)}", "e.g. stop=['\\n\\n']")
    problems.raise_if_any()
    if isinstance(model, InferenceModel):
        encoded = _encode(model.tokenizer, prompts, chat, model.seq_length, "the model")
        return _generate_all(model, prompts, encoded, sampling, max_new_tokens, stop, ignore_eos, batch_size)

    # Everything that can be wrong with the prompts is found before the model is built.
    source = resolve(os.fspath(model), step, base)
    tok = require_tokenizer(load_tokenizer(source, tokenizer), source, "generating text")
    encoded = _encode(tok, prompts, chat, declared_seq_length(source), source.describe())
    with load_model(source, tokenizer=tokenizer, tp=tp, dtype=dtype, backend=backend, preloaded_tokenizer=tok) as loaded:
        return _generate_all(loaded, prompts, encoded, sampling, max_new_tokens, stop, ignore_eos, batch_size)


def _encode(tokenizer: Any, prompts: list, chat: bool, seq_length: Optional[int], describe: str) -> list[list[int]]:
    if tokenizer is None:
        raise PromptError(f"{describe} has no tokenizer, which generating text needs (give one with --tokenizer DIR)")
    return encode_prompts(tokenizer, prompts, chat, seq_length or 2**62, describe)


def _batches(model: InferenceModel, encoded: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices of the prompts in each batch: similar lengths together (one length per batch for
    a sliding-window model, whose attention ignores padding masks)."""
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
    if not model.sliding_window:
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size and len(encoded[batches[-1][0]]) == len(encoded[i]):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _generate_all(model: InferenceModel, prompts: list, encoded: list[list[int]], sampling: Sampling, max_new_tokens: int,
                  stop: Sequence[str], ignore_eos: bool, batch_size: int) -> Generations:  # fmt: skip
    largest = max(max(ids) for ids in encoded)
    if largest >= model.vocab_size:
        raise PromptError(f"the prompts hold token id {largest}, beyond the model's vocabulary of {model.vocab_size} "
                          "(the tokenizer does not belong to this model)")  # fmt: skip
    results: list[Optional[Generation]] = [None] * len(prompts)
    out = Generations()
    with model.evaluating():
        for indices in _batches(model, encoded, batch_size):
            started = time.perf_counter()
            batch = _generate_batch(model, [encoded[i] for i in indices], indices, sampling, max_new_tokens, stop, ignore_eos)
            out.seconds += time.perf_counter() - started
            for i, (text, ids, reason) in zip(indices, batch):
                results[i] = Generation(prompts[i], text, ids, reason, list(encoded[i]))
    out.extend(results)
    return out


def _generate_batch(model: InferenceModel, prompts: list[list[int]], indices: list[int], sampling: Sampling,
                    max_new_tokens: int, stop: Sequence[str], ignore_eos: bool) -> list[tuple[str, list[int], str]]:  # fmt: skip
    from megatron_bridge.inference.kv_cache import CachedDecoder, left_pad

    limits = [min(max_new_tokens, model.seq_length - len(p)) for p in prompts]
    tokens, real = left_pad(prompts, pad_id=0, device=model.device)
    decoder = CachedDecoder(model, len(prompts), tokens.shape[1] + max(limits))
    generators = [g for i in indices for g in sampling.generators(i, 1, model.device)]
    stops = StopChecker(model.tokenizer, model.stop_ids if not ignore_eos else frozenset(), stop)
    new: list[list[int]] = [[] for _ in prompts]
    finished: list[Optional[str]] = [None] * len(prompts)
    logits = decoder.prefill(tokens, real)
    while True:
        chosen = _same_on_every_rank(sampling.choose(logits, generators))
        for row, token in enumerate(chosen.tolist()):
            if finished[row] is None:
                new[row].append(token)
                finished[row] = stops.reason(new[row]) or (LENGTH if len(new[row]) >= limits[row] else None)
        if all(finished):
            break
        logits = decoder.step(chosen)
    return [(stops.text(ids, reason), ids, reason) for ids, reason in zip(new, finished)]


def _same_on_every_rank(chosen: Any) -> Any:
    """Tensor-parallel ranks compute the same logits; the first rank's choice is taken by all,
    so their caches never diverge whatever the floating-point order of their reductions."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()) or ps.get_tensor_model_parallel_world_size() == 1:
        return chosen
    dist.broadcast(chosen, ps.get_tensor_model_parallel_src_rank(), group=ps.get_tensor_model_parallel_group())
    return chosen


class StopChecker:
    """When a generation ends (a stop token, a stop string) and the text it leaves."""

    def __init__(self, tokenizer: Any, stop_ids: frozenset, stop_strings: Sequence[str]):
        self.tokenizer, self.stop_ids, self.stop_strings = tokenizer, stop_ids, tuple(stop_strings)

    def reason(self, ids: list[int]) -> Optional[str]:
        if ids[-1] in self.stop_ids:
            return EOS
        if self.stop_strings and self._cut(self.tokenizer.detokenize(ids)) is not None:
            return STOP
        return None

    def _cut(self, text: str) -> Optional[int]:
        found = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        return min(found) if found else None

    def text(self, ids: list[int], reason: str) -> str:
        """The text of a finished generation."""
        body = ids[:-1] if reason == EOS else ids
        text = self.tokenizer.detokenize(body) if body else ""
        if reason == STOP:
            text = text[: self._cut(text)]
        return text
