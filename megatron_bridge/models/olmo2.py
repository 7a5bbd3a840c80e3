"""OLMo 2 (Allen Institute for AI): OLMo 2 7B, and its Hugging Face architecture
(`Olmo2ForCausalLM`).

The Llama architecture with the norms moved: no norm before attention and MLP, an RMSNorm on
each one's output inside the residual branch (`x + norm(attention(x))`), and RMSNorm over each
token's whole query and key projections (all heads together) before rotary embeddings. Built on
megatron-core's local layers with the project's layer modules (`models.layers`).
"""

from __future__ import annotations

from typing import Literal, Optional

from megatron_bridge.config.base import config_dataclass
from megatron_bridge.models.hf.family import HFFamily
from megatron_bridge.models.hf.mapping import Copy, Mapped
from megatron_bridge.models.hf.registry import register
from megatron_bridge.models.llama import LlamaModelProvider


@config_dataclass
class Olmo2ModelProvider(LlamaModelProvider):
    """OLMo 2: norms after attention and MLP only, qk-norm over the whole projections, RoPE base
    500000, a 100352-token vocabulary."""

    input_layernorms: bool = False
    """No norm before attention and MLP."""

    output_layernorms: bool = True
    """RMSNorm on the attention and MLP outputs before the residual add."""

    qk_layernorm: bool = True
    """Normalize queries and keys before RoPE."""

    qk_layernorm_per_head: bool = False
    """Over the whole query and key projections, not per head."""

    transformer_impl: Literal["local", "transformer_engine", "inference_optimized"] = "local"
    """megatron-core's local layers (TransformerEngine fuses the input norms OLMo 2 lacks)."""

    layernorm_epsilon: float = 1e-6
    """RMSNorm epsilon."""

    rotary_base: int = 500000
    """RoPE base period."""

    seq_length: int = 4096
    """Context length."""

    vocab_size: Optional[int] = 100352
    """Vocabulary size (the embedding rows)."""


@config_dataclass
class Olmo2ModelProvider7B(Olmo2ModelProvider):
    """OLMo 2 7B (7.30B parameters): multi-head attention."""

    num_layers: int = 32
    """Transformer layers."""

    hidden_size: int = 4096
    """Model width."""

    num_attention_heads: int = 32
    """Attention heads."""

    num_query_groups: Optional[int] = 32
    """Key/value heads (32: plain multi-head attention)."""

    ffn_hidden_size: Optional[int] = 11008
    """MLP width."""


# ---------------------------------------------------------------------- Hugging Face
LAYER_FIELDS = {
    "input_layernorms": False,
    "output_layernorms": True,
    "qk_layernorm": True,
    "qk_layernorm_per_head": False,
}


@register
class Olmo2Family(HFFamily):
    """`Olmo2ForCausalLM`: `post_attention_layernorm` and `post_feedforward_layernorm` on the
    attention and MLP outputs, `self_attn.q_norm` / `k_norm` over the whole projections."""

    architecture = "Olmo2ForCausalLM"
    model_type = "olmo2"
    provider = Olmo2ModelProvider

    def provider_fields(self, read):
        return {**super().provider_fields(read), **LAYER_FIELDS}

    def settings(self):
        return {**super().settings(), **LAYER_FIELDS}

    def hf_config(self, p, dtype):
        return {**super().hf_config(p, dtype), "attention_bias": False}

    def norm_tensors(self, a, L):
        p = f"model.layers.{L}"
        return {
            "self_attn_bda.norm.weight": Mapped((a.hidden,), Copy(f"{p}.post_attention_layernorm.weight")),
            "mlp_bda.norm.weight": Mapped((a.hidden,), Copy(f"{p}.post_feedforward_layernorm.weight")),
        }

    def attention_tensors(self, a, L):
        attn = f"model.layers.{L}.self_attn"
        return {
            **super().attention_tensors(a, L),
            "self_attention.q_layernorm.weight": Mapped((a.heads * a.head_dim,), Copy(f"{attn}.q_norm.weight")),
            "self_attention.k_layernorm.weight": Mapped((a.groups * a.head_dim,), Copy(f"{attn}.k_norm.weight")),
        }
