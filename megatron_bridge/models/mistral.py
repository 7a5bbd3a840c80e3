"""Mistral AI models: Mistral 7B (v0.1) and the Mixtral 8x7B mixture of experts.

Both use the Llama architecture (see `LlamaModelProvider`) with grouped-query attention, a
32000-token vocabulary and their own RoPE bases.
"""

from __future__ import annotations

from typing import List, Literal, Optional, Tuple, Union

from megatron_bridge.config.base import config_dataclass
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

    window_size: Optional[Tuple[int, int]] = (4096, 0)
    """Sliding attention window: each token sees the previous 4096 tokens."""


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
