"""Word embeddings multiplied by sqrt(hidden_size) (Gemma's `scale_embeddings`).

The factor is computed as transformers' Gemma computes it: `hidden_size ** 0.5` held as an fp32
tensor, cast to the dtype of the embedding output (the weights' dtype) before the multiply, so a
bf16 model multiplies by the bf16-rounded factor (sqrt(3072) = 55.4256 becomes 55.5) exactly as
the model was trained. It applies to the lookup itself, before megatron-core's embedding dropout
and sequence-parallel scatter (both commute with a constant factor), and to every use of the
embedding module (multi-token prediction layers share it).
"""

from __future__ import annotations

from typing import Any

import torch


def scale_word_embeddings(model: torch.nn.Module, hidden_size: int) -> None:
    """Multiply the output of `model.embedding.word_embeddings` (a megatron-core GPTModel on a
    stage that embeds) by sqrt(hidden_size), cast as described in the module docstring."""
    factor = torch.tensor(hidden_size**0.5, dtype=torch.float32)

    def scaled(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output * factor.to(device=output.device, dtype=output.dtype)

    model.embedding.word_embeddings.register_forward_hook(scaled)
