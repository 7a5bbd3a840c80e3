"""Incremental decoding with a key/value cache: each new token costs one position's forward.

megatron-core's `StaticInferenceContext` holds the keys and values of every layer for a batch;
its attention writes a step's keys and values at the context's sequence offset and attends over
everything cached so far, so a step processes one token whatever the length of the prefix.

Prompts of different lengths are padded on the left: every row's last prompt token sits in the
same slot, and the new tokens of all rows go into the same slots after it. The attention mask
hides the padding slots from every query; position ids count each row's real tokens from 0
(learned position embeddings read them; rotary embeddings, which megatron-core indexes by slot,
only see offsets between slots, which the padding shifts equally for every token of a row).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_bridge.inference.model import InferenceModel


class CachedDecoder:
    """Decodes one batch: `prefill` the left-padded prompts, then `step` one token per row."""

    def __init__(self, model: InferenceModel, batch_size: int, max_length: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.model = model
        self.max_length = max_length
        self.context = StaticInferenceContext(batch_size, max_length)
        self.device = model.device
        self.visible = torch.zeros(batch_size, max_length, dtype=torch.bool, device=self.device)
        """visible[b, s]: slot s of row b holds a real token (not padding)."""
        self.length = 0
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def prefill(self, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Run the prompts `tokens` [batch, length] (`real` marks non-padding, padding on the
        left); returns the logits of each row's next token [batch, vocab]."""
        batch, length = tokens.shape
        if length > self.max_length:
            raise ValueError(f"prompts of {length} tokens do not fit a cache of {self.max_length}")
        self.visible[:, :length] = real
        positions = (real.long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).tril()
        allowed = causal[None] & real[:, None, :]
        # A padding slot attends to itself only, so its (unused) output stays finite.
        allowed |= torch.eye(length, dtype=torch.bool, device=self.device)[None]
        logits = self.model.logits(tokens, positions, ~allowed[:, None], inference_context=self.context)
        self.context.sequence_len_offset += length
        self.context.enable_decode_mode()
        self.length = length
        self.positions = positions[:, -1]
        return logits[:, -1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row [batch]; returns the logits of the next one [batch, vocab]."""
        if self.length >= self.max_length:
            raise ValueError(f"the cache holds {self.max_length} positions, all used")
        self.visible[:, self.length] = True
        # A row that has finished keeps stepping with the others; its position stays in range.
        self.positions = (self.positions + 1).clamp(max=self.model.seq_length - 1)
        self.length += 1
        mask = ~self.visible[:, None, None, : self.length]
        logits = self.model.logits(tokens[:, None], self.positions[:, None], mask, inference_context=self.context)
        self.context.sequence_len_offset += 1
        return logits[:, -1]


def left_pad(prompts: list[list[int]], pad_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, real) of prompts padded on the left to the longest."""
    length = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    real = torch.zeros(len(prompts), length, dtype=torch.bool)
    for row, ids in enumerate(prompts):
        tokens[row, length - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        real[row, length - len(ids) :] = True
    return tokens.to(device), real.to(device)
