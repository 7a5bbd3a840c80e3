"""`LatentDotProductAttention`: the core attention of multi-latent attention (MLA) on
megatron-core's local layers.

megatron-core's `MLASelfAttention` builds its core attention with the head sizes of its keys
(`k_channels`: the no-rope plus the rope part) and of its values (`v_channels`), which differ.
Its local spec names megatron-core's `DotProductAttention`, which takes neither and lays its
output out as `kv_channels` per head, so MLA on local layers (CPU runs, or GPUs without
TransformerEngine) fails to build. This subclass takes both and lays the output out per value
head; the scores, mask, softmax and dropout are `DotProductAttention`'s own.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron_bridge.models.layers.spec_edits import edit_layers


class LatentDotProductAttention(DotProductAttention):
    """megatron-core's unfused core attention with key and value heads of different sizes."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        if v_channels is not None:
            # the context is [sq, b, heads of this rank x value head size]
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


class LatentNorm:
    """A norm spec (`norm`) built with epsilon `latent_eps` instead of the config's: MLA builds its
    query and key/value latent norms with `layernorm_epsilon`, which DeepSeek's models do not."""

    def __new__(cls, hidden_size: int, config: Any, eps: Optional[float] = None, norm: Any = None,
                latent_eps: Optional[float] = None):  # fmt: skip
        from megatron.core.transformer.spec_utils import build_module

        return build_module(norm, hidden_size=hidden_size, config=config, eps=latent_eps)


def _name(spec: Any) -> str:
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    return getattr(module, "__name__", "")


def mla_layer_spec(block_spec: Any, latent_eps: float, layernorm_eps: float) -> Any:
    """`block_spec` with, in every MLA layer: megatron-core's local `DotProductAttention`
    replaced by `LatentDotProductAttention`, and the latent norms built with `latent_eps` where
    it differs from `layernorm_eps` (TransformerEngine's norms fused into the up projections are
    then unfused: the fused ones take the config's epsilon)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    def edit(layer: ModuleSpec, number: Optional[int]) -> ModuleSpec:
        attention = layer.submodules.self_attention
        if not (isinstance(attention, ModuleSpec) and attention.module is MLASelfAttention):
            return layer
        sub = attention.submodules
        if _name(sub.core_attention) == DotProductAttention.__name__:
            sub.core_attention = LatentDotProductAttention
        if latent_eps == layernorm_eps:
            return layer
        for up, norm in (("linear_q_up_proj", "q_layernorm"), ("linear_kv_up_proj", "kv_layernorm")):
            if _name(getattr(sub, up)) == "TELayerNormColumnParallelLinear":
                from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

                setattr(sub, up, TEColumnParallelLinear)
                setattr(sub, norm, TENorm)
            if getattr(sub, norm) is not IdentityOp:
                spec = ModuleSpec(module=LatentNorm, params={"norm": getattr(sub, norm), "latent_eps": latent_eps})
                setattr(sub, norm, spec)
        return layer

    return edit_layers(block_spec, edit)


def mla_without_te() -> None:
    """megatron-core 0.16's MLA module checks its output projection against TransformerEngine's
    `TELinear` even where TE is not installed, where that name is a mock and `isinstance` fails
    (a TypeError at build). There its flag for TE's presence is set to what it is: absent."""
    from megatron.core.transformer import multi_latent_attention

    from megatron_bridge.extras import is_installed

    if not is_installed("transformer_engine"):
        multi_latent_attention.HAVE_TE = False
