"""Qwen models (Alibaba): Qwen2.5 7B, Qwen3 8B and the Qwen3 30B-A3B mixture of experts.

All use the Llama architecture (see `LlamaModelProvider`) with RoPE base 1e6 and RMSNorm
epsilon 1e-6; Qwen2.5 adds biases to the query/key/value projection, Qwen3 normalizes queries
and keys per head instead. Hugging Face architectures: `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
`Qwen3MoeForCausalLM`.
"""

from __future__ import annotations

from typing import List, Literal, Optional, Union

from megatron_bridge.config.base import config_dataclass
from megatron_bridge.models.hf.family import HFFamily, has_experts, read_renormalized_topk, scalar
from megatron_bridge.models.hf.mapping import Copy, Mapped
from megatron_bridge.models.hf.registry import register
from megatron_bridge.models.llama import LlamaModelProvider


@config_dataclass
class Qwen2ModelProvider(LlamaModelProvider):
    """Qwen2 / Qwen2.5: the Llama architecture with query/key/value biases."""

    add_qkv_bias: bool = True
    """Biases on the query/key/value projection (the only biases)."""

    layernorm_epsilon: float = 1e-6
    """RMSNorm epsilon."""

    rotary_base: int = 1000000
    """RoPE base period."""

    seq_length: int = 32768
    """Context length."""

    vocab_size: Optional[int] = 151936
    """Vocabulary size."""


@config_dataclass
class Qwen25ModelProvider7B(Qwen2ModelProvider):
    """Qwen2.5 7B (7.62B parameters)."""

    num_layers: int = 28
    """Transformer layers."""

    hidden_size: int = 3584
    """Model width."""

    num_attention_heads: int = 28
    """Attention heads."""

    num_query_groups: Optional[int] = 4
    """Key/value heads."""

    ffn_hidden_size: Optional[int] = 18944
    """MLP width."""

    vocab_size: Optional[int] = 152064
    """Vocabulary size (the embedding rows of the 7B model)."""


@config_dataclass
class Qwen3ModelProvider(LlamaModelProvider):
    """Qwen3: the Llama architecture with RMSNorm on each head's queries and keys, head size 128."""

    qk_layernorm: bool = True
    """Normalize queries and keys per head before RoPE."""

    kv_channels: Optional[int] = 128
    """Head size (independent of hidden_size / heads)."""

    layernorm_epsilon: float = 1e-6
    """RMSNorm epsilon."""

    rotary_base: int = 1000000
    """RoPE base period."""

    seq_length: int = 40960
    """Context length."""

    vocab_size: Optional[int] = 151936
    """Vocabulary size."""


@config_dataclass
class Qwen3ModelProvider8B(Qwen3ModelProvider):
    """Qwen3 8B (8.19B parameters)."""

    num_layers: int = 36
    """Transformer layers."""

    hidden_size: int = 4096
    """Model width."""

    num_attention_heads: int = 32
    """Attention heads."""

    num_query_groups: Optional[int] = 8
    """Key/value heads."""

    ffn_hidden_size: Optional[int] = 12288
    """MLP width."""


@config_dataclass
class Qwen3MoEModelProvider(Qwen3ModelProvider):
    """Qwen3 mixture of experts: every MLP is 128 small experts, each token routed to 8 (softmax
    over the chosen 8), no shared expert."""

    num_moe_experts: Optional[int] = 128
    """Experts per MoE layer."""

    moe_router_topk: int = 8
    """Experts each token is routed to."""

    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    """Load balancing through an auxiliary loss."""

    moe_aux_loss_coeff: Union[float, List[float]] = 1e-3
    """Weight of the load-balancing loss (the published router_aux_loss_coef)."""

    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = "fp32"
    """Route in fp32: with this many experts, bf16 router scores are too coarse."""

    moe_grouped_gemm: bool = True
    """Run the local experts as one grouped GEMM."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "alltoall"
    """All-to-all token exchange between expert-parallel ranks."""


@config_dataclass
class Qwen3MoEModelProvider30B_A3B(Qwen3MoEModelProvider):
    """Qwen3 30B-A3B (30.5B parameters in total, 3.3B active per token)."""

    num_layers: int = 48
    """Transformer layers."""

    hidden_size: int = 2048
    """Model width."""

    num_attention_heads: int = 32
    """Attention heads."""

    num_query_groups: Optional[int] = 4
    """Key/value heads."""

    ffn_hidden_size: Optional[int] = 6144
    """Width of a dense MLP (unused: every layer is MoE)."""

    moe_ffn_hidden_size: Optional[int] = 768
    """Width of each expert's MLP."""


# ---------------------------------------------------------------------- Hugging Face
@register
class Qwen2Family(HFFamily):
    """`Qwen2ForCausalLM` (Qwen2, Qwen2.5): the Llama layout with query/key/value biases."""

    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    provider = Qwen2ModelProvider

    def read_attention(self, read):
        return {"add_qkv_bias": True}

    def settings(self):
        return {**super().settings(), "add_qkv_bias": True}

    def hf_config(self, p, dtype):
        return {**super().hf_config(p, dtype), "use_sliding_window": False}

    def attention_tensors(self, a, L):
        bias = Mapped((self.qkv_rows(a),), self.qkv(a, L, "bias"))
        return {**super().attention_tensors(a, L), "self_attention.linear_qkv.bias": bias}


@register
class Qwen3Family(HFFamily):
    """`Qwen3ForCausalLM`: the Llama layout with RMSNorm on each query and key head
    (`self_attn.q_norm`, `self_attn.k_norm`)."""

    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    provider = Qwen3ModelProvider

    def read_attention(self, read):
        return {**super().read_attention(read), "qk_layernorm": True}

    def settings(self):
        return {**super().settings(), "qk_layernorm": True}

    def hf_config(self, p, dtype):
        return {**super().hf_config(p, dtype), "attention_bias": False, "use_sliding_window": False}

    def attention_tensors(self, a, L):
        attn = f"model.layers.{L}.self_attn"
        return {
            **super().attention_tensors(a, L),
            "self_attention.q_layernorm.weight": Mapped((a.head_dim,), Copy(f"{attn}.q_norm.weight")),
            "self_attention.k_layernorm.weight": Mapped((a.head_dim,), Copy(f"{attn}.k_norm.weight")),
        }


@register
class Qwen3MoeFamily(Qwen3Family):
    """`Qwen3MoeForCausalLM`: Qwen3 with a mixture of experts in every layer (`mlp.gate` router,
    `mlp.experts.E.{gate,up,down}_proj`)."""

    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    provider = Qwen3MoEModelProvider

    def read_mlp(self, read, kw):
        experts = "num_experts" if "num_experts" in read.hf else "num_local_experts"  # transformers 4 / 5
        normalized = read.bool("norm_topk_prob", default=False)
        if normalized:
            topk = read_renormalized_topk(read, "norm_topk_prob", why="True with num_experts_per_tok = 1")
        else:
            topk = read.int("num_experts_per_tok")
        out = dict(
            num_moe_experts=read.int(experts),
            moe_router_topk=topk,
            moe_ffn_hidden_size=read.int("moe_intermediate_size"),
            moe_aux_loss_coeff=read.float("router_aux_loss_coef", default=1e-3),
            # normalized top-k: softmax over the chosen experts; otherwise over all of them
            moe_router_pre_softmax=not normalized,
        )
        read.expect("decoder_sparse_step", 1, "every layer must be a mixture-of-experts layer")
        read.expect("mlp_only_layers", [], "every layer must be a mixture-of-experts layer")
        return out

    def settings(self):
        return {**super().settings(), "num_moe_experts": has_experts}

    def hf_config(self, p, dtype):
        return {
            **super().hf_config(p, dtype),
            "num_experts": p.num_moe_experts,
            "num_experts_per_tok": p.moe_router_topk,
            "moe_intermediate_size": p.moe_ffn_hidden_size,
            "norm_topk_prob": not p.moe_router_pre_softmax,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": scalar(p.moe_aux_loss_coeff),
        }

    def experts_of(self, hf):
        return {
            "num_experts": hf.get("num_experts") or hf.get("num_local_experts") or 0,
            "moe_ffn": hf.get("moe_intermediate_size") or hf.get("intermediate_size", 0),
        }
