"""Mistral AI models: Mistral 7B (v0.1) and the Mixtral 8x7B mixture of experts.

Both use the Llama architecture (see `LlamaModelProvider`) with grouped-query attention, a
32000-token vocabulary and their own RoPE bases. Hugging Face architectures: `MistralForCausalLM`,
`MixtralForCausalLM`.
"""

from __future__ import annotations

from typing import List, Literal, Optional, Tuple, Union

from megatron_bridge.config.base import config_dataclass
from megatron_bridge.models.hf.family import HFFamily, causal_window, has_experts, read_renormalized_topk, scalar
from megatron_bridge.models.hf.registry import register
from megatron_bridge.models.llama import LlamaModelProvider


@config_dataclass
class MistralModelProvider(LlamaModelProvider):
    """Mistral: the Llama architecture with 8 key/value heads and a 32000-token vocabulary."""

    num_query_groups: Optional[int] = 8
    """Key/value heads."""

    vocab_size: Optional[int] = 32000
    """Vocabulary size."""

    rotary_base: int = 10000
    """RoPE base period."""

    seq_length: int = 32768
    """Context length."""


@config_dataclass
class MistralModelProvider7B(MistralModelProvider):
    """Mistral 7B v0.1 (7.24B parameters), with sliding-window attention over 4096 tokens."""

    num_layers: int = 32
    """Transformer layers."""

    hidden_size: int = 4096
    """Model width."""

    num_attention_heads: int = 32
    """Attention heads."""

    ffn_hidden_size: Optional[int] = 14336
    """MLP width."""

    window_size: Optional[Tuple[int, int]] = (4095, 0)
    """Sliding attention window: each token sees itself and the 4095 tokens before it (the
    published `sliding_window: 4096`)."""


@config_dataclass
class MixtralModelProvider(MistralModelProvider):
    """Mixtral: Mistral with a sparse mixture-of-experts MLP in every layer (8 experts, each
    token routed to 2), RoPE base 1e6, no sliding window."""

    rotary_base: int = 1000000
    """RoPE base period."""

    num_moe_experts: Optional[int] = 8
    """Experts per MoE layer."""

    moe_router_topk: int = 2
    """Experts each token is routed to."""

    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    """Load balancing through an auxiliary loss."""

    moe_aux_loss_coeff: Union[float, List[float]] = 0.02
    """Weight of the load-balancing loss (the published router_aux_loss_coef)."""

    moe_grouped_gemm: bool = True
    """Run the local experts as one grouped GEMM."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "alltoall"
    """All-to-all token exchange between expert-parallel ranks."""


@config_dataclass
class MixtralModelProvider8x7B(MixtralModelProvider):
    """Mixtral 8x7B (46.7B parameters in total, 12.9B active per token)."""

    num_layers: int = 32
    """Transformer layers."""

    hidden_size: int = 4096
    """Model width."""

    num_attention_heads: int = 32
    """Attention heads."""

    ffn_hidden_size: Optional[int] = 14336
    """Width of a dense MLP (unused: every layer is MoE)."""

    moe_ffn_hidden_size: Optional[int] = 14336
    """Width of each expert's MLP."""


# ---------------------------------------------------------------------- Hugging Face
@register
class MistralFamily(HFFamily):
    """`MistralForCausalLM`: the Llama layout with a sliding window on every layer."""

    architecture = "MistralForCausalLM"
    model_type = "mistral"
    provider = MistralModelProvider

    def read_window(self, read):
        return self.read_sliding_window(read)

    def settings(self):
        return {**super().settings(), "window_size": causal_window}

    def hf_config(self, p, dtype):
        window = p.window_size[0] + 1 if p.window_size is not None else None
        return {**super().hf_config(p, dtype), "sliding_window": window}


@register
class MixtralFamily(MistralFamily):
    """`MixtralForCausalLM`: Mistral with a mixture of experts in every layer
    (`block_sparse_moe`: router `gate`, experts `w1` gate, `w3` up, `w2` down)."""

    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    provider = MixtralModelProvider

    def read_mlp(self, read, kw):
        jitter = read.float("router_jitter_noise", default=0.0)
        return dict(
            num_moe_experts=read.int("num_local_experts"),
            moe_router_topk=read_renormalized_topk(read),
            moe_ffn_hidden_size=kw["ffn_hidden_size"],
            moe_aux_loss_coeff=read.float("router_aux_loss_coef", default=0.02),
            moe_input_jitter_eps=jitter or None,
        )

    def settings(self):
        # Mixtral's router renormalizes the top-k softmax weights: softmax over the chosen experts
        return {**super().settings(), "num_moe_experts": has_experts, "moe_router_pre_softmax": False}

    def hf_config(self, p, dtype):
        return {
            **super().hf_config(p, dtype),
            "num_local_experts": p.num_moe_experts,
            "num_experts_per_tok": p.moe_router_topk,
            "intermediate_size": p.moe_ffn_hidden_size,
            "router_aux_loss_coef": scalar(p.moe_aux_loss_coeff),
            "router_jitter_noise": p.moe_input_jitter_eps or 0.0,
        }

    def experts_of(self, hf):
        return {"num_experts": hf.get("num_local_experts") or 0, "moe_ffn": hf.get("intermediate_size", 0)}

    def router_name(self, L):
        return f"model.layers.{L}.block_sparse_moe.gate.weight"

    def expert_names(self, L, E):
        base = f"model.layers.{L}.block_sparse_moe.experts.{E}"
        return f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"
