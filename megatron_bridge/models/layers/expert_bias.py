"""Experts with biases run one GEMM each: megatron-core's `SequentialMLP`, each expert's output
weighted as `(fc2(h) + fc2.bias) * prob`, out of place.

megatron-core 0.16.1's expert MLP adds `fc2.bias * prob` in place into the output of its
row-parallel layer, which autograd refuses whenever gradients are on (that output is a view made
inside a custom autograd Function): a model with expert biases cannot train, nor run a forward
pass with gradients enabled. `BiasedSequentialMLP` calls each expert unweighted (fc1, the
activation, fc2, its bias returned apart) and weights output and bias together, as Hugging Face's
GPT-OSS experts do. `with_biased_experts` puts it in a decoder block spec in place of
`SequentialMLP` when the model has expert biases.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_bridge.models.layers.spec_edits import edit_layers


class BiasedSequentialMLP(SequentialMLP):
    """`SequentialMLP` for experts with biases (see the module docstring); without biases or with
    FP8/FP4 padding, megatron-core's own. With `moe_apply_probs_on_input` the probabilities scale
    the expert input, as megatron-core does, and the outputs are not weighted again."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        c = self.config
        if not c.add_bias_linear or c.fp8 or c.fp4:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        if c.moe_apply_probs_on_input:  # one expert per token (a validation rule)
            dtype = permuted_local_hidden_states.dtype
            permuted_local_hidden_states = (permuted_probs.unsqueeze(-1) * permuted_local_hidden_states).to(dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        counts = tokens_per_expert.tolist()
        tokens = torch.split(permuted_local_hidden_states, counts)
        probs = torch.split(permuted_probs, counts)
        outputs = []
        for expert, x, p in zip(self.local_experts, tokens, probs):
            y, bias = expert(x)
            if bias is not None:
                y = y + bias
            outputs.append((y * p.unsqueeze(-1)).to(y.dtype))
        return torch.cat(outputs), None


def with_biased_experts(provider: Any, block_spec: Any) -> Any:
    """`block_spec` with `BiasedSequentialMLP` for `SequentialMLP` in its MoE layers, if the
    experts have biases (`add_bias_linear`); else `block_spec` itself."""
    if not provider.num_moe_experts or not provider.add_bias_linear:
        return block_spec

    def edit(layer, number):
        mlp = layer.submodules.mlp
        experts = getattr(getattr(mlp, "submodules", None), "experts", None)
        if getattr(mlp, "module", None) is MoELayer and getattr(experts, "module", None) is SequentialMLP:
            experts.module = BiasedSequentialMLP
        return layer

    return edit_layers(block_spec, edit)
