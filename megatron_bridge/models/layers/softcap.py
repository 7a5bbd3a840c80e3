"""Logit soft-capping (Gemma 2): `cap * tanh(x / cap)`, smooth and bounded by +-cap.

* Attention scores (`attention_logit_softcap`): `SoftcapDotProductAttention` is megatron-core's
  unfused local core attention (with the window composed into the mask, as
  `attention_masks.WindowedDotProductAttention`) whose scaled scores are capped before the mask
  and softmax. SDPA and TransformerEngine have no hook between scores and softmax: the provider
  sends such configs to this module and refuses the others.
* Output logits (`output_logit_softcap`): the output layer's logits are capped where it computes
  them (`cap_output_logits`), before the loss, on each tensor-parallel rank's vocabulary slice
  (the cap is elementwise).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_bridge.models.attention_masks import WindowedDotProductAttention


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """`cap * tanh(x / cap)`, in the order transformers' Gemma computes it."""
    return torch.tanh(x / cap) * cap


class _CappedSoftmax(torch.nn.Module):
    """megatron-core's scale-mask-softmax with the scores capped first."""

    def __init__(self, softmax: torch.nn.Module, cap: float):
        super().__init__()
        self.softmax = softmax
        self.cap = cap

    def forward(self, scores: torch.Tensor, mask: Any, *args: Any) -> torch.Tensor:
        return self.softmax(softcap(scores, self.cap), mask, *args)


class SoftcapDotProductAttention(WindowedDotProductAttention):
    """megatron-core's unfused core attention with `config.attention_logit_softcap` applied to
    the scaled scores (`softmax_scale * q.k`). The provider refuses
    `apply_query_key_layer_scaling` with it: that divides the scores by the layer number before
    the softmax and multiplies them back inside it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale_mask_softmax = _CappedSoftmax(self.scale_mask_softmax, float(self.config.attention_logit_softcap))


def cap_output_logits(model: torch.nn.Module, cap: float) -> None:
    """Cap the logits of `model`'s output layer (a megatron-core GPTModel on its last pipeline
    stage) as it returns them."""

    def capped(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        logits, bias = output
        return softcap(logits, cap), bias

    model.output_layer.register_forward_hook(capped)
