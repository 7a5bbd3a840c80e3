"""A norm on the output of attention or of the MLP, inside the residual branch.

megatron-core's transformer layer adds each branch to the residual stream through its
bias-dropout-add submodule (`self_attn_bda`, `mlp_bda`): `residual + dropout(output + bias)`.
`NormedBiasDropoutAdd` is that submodule with a norm in front: `residual + dropout(norm(output +
bias))`, the norms after attention and MLP of OLMo 2 and Gemma 2/3. The attention and MLP modules
stay megatron-core's own (so adapters on `linear_proj` / `linear_fc2` stay before the norm, where
a Hugging Face adapter on `o_proj` / `down_proj` is), and the norm's parameters are
`...self_attn_bda.norm.weight` and `...mlp_bda.norm.weight`. The norm class is the block's (the
other norms'), or a family's own.

Parallelism: the output of a row-parallel projection is complete on every tensor-parallel rank
after its all-reduce, so the norm, per token over the hidden size, is replicated. With sequence
parallelism each rank holds whole tokens of a slice of the sequence; the weight's gradients are
then summed over the ranks by norm classes that support sequence parallelism (they mark their
weights), and megatron-core's torch norms refuse it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


class NormedBiasDropoutAdd(torch.nn.Module):
    """`residual + dropout(norm(x + bias))`, called as megatron-core calls its bias-dropout-add:
    `module(training, fused)(x_with_bias, residual, dropout_probability)`."""

    def __init__(self, config: Any, norm: Any):
        super().__init__()
        self.norm = build_module(norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, training: bool, fused: bool) -> Callable:
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

        add = get_bias_dropout_add(training, fused)

        def normed_add(x_with_bias: tuple, residual: torch.Tensor, prob: float) -> torch.Tensor:
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            return add((self.norm(x), None), residual, prob)

        return normed_add


def normed_bda(config: Any, norm: Any) -> ModuleSpec:
    """The spec of a bias-dropout-add with `norm` (a norm class or spec) in front, for a layer
    built with `config`."""
    return ModuleSpec(module=NormedBiasDropoutAdd, params={"config": config, "norm": norm})
