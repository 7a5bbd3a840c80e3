"""Editing a built decoder block spec, layer by layer; the provider's layer fields built into it.

`GPTModelProvider.layer_spec` builds megatron-core's decoder block spec, then `apply_layer_fields`
turns the fields megatron-core lacks into submodules, then the provider's `adjust_layer_spec`
hook may edit it further. Edits replace only the submodules they are about (norms, the attention
or MLP module class), so they compose with each other and with other edits of the spec (a core
attention module, say).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_bridge.models.layers.output_norm import normed_bda
from megatron_bridge.models.layers.projection_norm import ProjectionNorm
from megatron_bridge.models.layers.zero_centered_norm import ZeroCenteredRMSNorm
from megatron_bridge.models.layers.local_rotary import LocalRotarySelfAttention


def layer_numbers(provider: Any, vp_stage: Optional[int], count: int) -> list[int]:
    """The global numbers (from 1, as megatron-core numbers them) of the `count` layers this
    pipeline stage (and virtual stage) builds."""
    layout = getattr(provider, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType

        return [i + 1 for i in layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage)]
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(provider, vp_stage=vp_stage)
    return [offset + i + 1 for i in range(count)]


def edit_layers(block_spec: Any, edit: Callable[[ModuleSpec, Optional[int]], ModuleSpec],
                numbers: Optional[list[int]] = None) -> Any:  # fmt: skip
    """A copy of `block_spec` (megatron-core's `TransformerBlockSubmodules`) whose layer specs are
    `edit(copy of the layer's spec, its global layer number)`: `numbers` from `layer_numbers`
    for edits that differ by layer, else None."""
    if numbers is None:
        numbers = [None] * len(block_spec.layer_specs)
    if len(numbers) != len(block_spec.layer_specs):
        raise ValueError(f"{len(numbers)} layer numbers for {len(block_spec.layer_specs)} layer specs")
    block = copy.copy(block_spec)
    block.layer_specs = [edit(copy.deepcopy(spec), n) for spec, n in zip(block_spec.layer_specs, numbers)]
    return block


def changes_layers(provider: Any) -> bool:
    """Whether any layer field asks for more than megatron-core's spec builds."""
    p = provider
    return not p.input_layernorms or p.output_layernorms or (p.qk_layernorm and not p.qk_layernorm_per_head)


def apply_layer_fields(provider: Any, block_spec: Any) -> Any:
    """`block_spec` with the provider's `input_layernorms=False` (no norm before attention and
    MLP), `output_layernorms` (a norm after each, of the block's norm class),
    `qk_layernorm_per_head=False` (queries and keys normalized over the whole projection),
    `layernorm_zero_centered_gamma` on local RMSNorm layers (every norm a `ZeroCenteredRMSNorm`)
    and `local_rotary_base` (attention that rotates window layers with their own base)."""
    p = provider
    block_spec = zero_centered_norms(p, block_spec)  # first: output norms take the block's norm class
    local_rotary = getattr(p, "local_rotary_base", None) is not None
    if not changes_layers(p) and not local_rotary:
        return block_spec
    norm = block_spec.layer_norm

    def edit(layer: ModuleSpec, number: Optional[int]) -> ModuleSpec:
        sub = layer.submodules
        if not p.input_layernorms:
            sub.input_layernorm = IdentityOp
            sub.pre_mlp_layernorm = IdentityOp
        if p.qk_layernorm and not p.qk_layernorm_per_head:
            attention = sub.self_attention.submodules
            attention.q_layernorm = ModuleSpec(module=ProjectionNorm, params={"which": "query"})
            attention.k_layernorm = ModuleSpec(module=ProjectionNorm, params={"which": "key"})
        if p.output_layernorms:
            sub.self_attn_bda = normed_bda(p, norm)
            sub.mlp_bda = normed_bda(p, norm)
        if local_rotary:
            from megatron.core.transformer.attention import SelfAttention

            if sub.self_attention.module is not SelfAttention:
                raise ValueError(f"local_rotary_base needs megatron-core's SelfAttention, not {sub.self_attention.module}")
            sub.self_attention.module = LocalRotarySelfAttention
        return layer

    return edit_layers(block_spec, edit)


def zero_centered_norms(provider: Any, block_spec: Any) -> Any:
    """With `layernorm_zero_centered_gamma`, `block_spec` with megatron-core's local torch
    RMSNorm (which refuses the setting) replaced by `ZeroCenteredRMSNorm` everywhere: the block's
    final norm and each layer's input, pre-MLP, query and key norms. TransformerEngine's norms
    implement the setting themselves and stay."""
    if not provider.layernorm_zero_centered_gamma:
        return block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def swap(module: Any) -> Any:
        return ZeroCenteredRMSNorm if module is WrappedTorchNorm else module

    def edit(layer: ModuleSpec, number: Optional[int]) -> ModuleSpec:
        sub = layer.submodules
        sub.input_layernorm = swap(sub.input_layernorm)
        sub.pre_mlp_layernorm = swap(sub.pre_mlp_layernorm)
        attention = getattr(sub.self_attention, "submodules", None)
        for name in ("q_layernorm", "k_layernorm"):
            if hasattr(attention, name):
                setattr(attention, name, swap(getattr(attention, name)))
        return layer

    block = edit_layers(block_spec, edit)
    block.layer_norm = swap(block.layer_norm)
    return block
