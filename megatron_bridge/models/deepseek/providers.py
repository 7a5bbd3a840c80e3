"""DeepSeek-V3 (DeepSeek-AI) and the models built on its architecture: DeepSeek-V3 671B and
Moonlight 16B-A3B (Moonshot AI), and its Hugging Face architecture (`DeepseekV3ForCausalLM`, also
DeepSeek-R1 and Kimi K2).

The architecture: multi-latent attention (MLA, megatron-core's `MLASelfAttention`: queries from a
low-rank projection or a plain one, keys and values from one shared low-rank latent, a rope and a
no-rope part per head, YaRN rope scaling), RMSNorm, the first layers with a dense SwiGLU MLP and
the rest a mixture of experts with shared experts, routed by a sigmoid router with an expert
bias (aux-loss-free balancing) and group-limited routing. Multi-token-prediction layers are not
built (see `DeepseekV3Family`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, List, Literal, Optional, Union

import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_bridge.config.base import config_dataclass, field
from megatron_bridge.config.errors import Problems, show
from megatron_bridge.models.gpt_provider import GPTModelProvider

logger = logging.getLogger("megatron_bridge")


def dense_then_moe(dense: int, num_layers: int) -> list[int]:
    """megatron-core's `moe_layer_freq` for `dense` dense layers followed by MoE layers."""
    return [0] * dense + [1] * (num_layers - dense)


def leading_dense_layers(provider: Any) -> Optional[int]:
    """How many dense layers come first when every later one is MoE (None: another pattern)."""
    n, freq = provider.num_layers, provider.moe_layer_freq
    pattern = [int(i % freq == 0) for i in range(n)] if isinstance(freq, int) else [int(bool(x)) for x in freq]
    dense = pattern.index(1) if 1 in pattern else len(pattern)
    return dense if len(pattern) == n and pattern == dense_then_moe(dense, n) else None


@config_dataclass
class DeepSeekModelProvider(GPTModelProvider, MLATransformerConfig):
    """The DeepSeek-V3 architecture (sizes from the subclasses): MLA, RMSNorm, SwiGLU, untied
    output layer; dense first layers, then MoE layers with shared experts and a sigmoid router
    with expert bias."""

    multi_latent_attention: bool = True
    """Multi-latent attention (megatron-core's MLASelfAttention)."""

    q_lora_rank: Optional[int] = 1536
    """Rank of the low-rank query projection (None: queries come from one full projection)."""

    kv_lora_rank: int = 512
    """Rank of the latent that keys and values are projected up from."""

    qk_head_dim: int = 128
    """Per head: query and key dimensions without rotary embeddings."""

    qk_pos_emb_head_dim: int = 64
    """Per head: query and key dimensions with rotary embeddings (keys share them over heads)."""

    v_head_dim: int = 128
    """Per head: value dimensions."""

    kv_channels: Optional[int] = 128
    """The value head size (v_head_dim): MLA sizes its heads by qk_head_dim, qk_pos_emb_head_dim
    and v_head_dim; the core attention lays its output out by this."""

    qk_layernorm: bool = True
    """RMSNorm on the query and key/value latents (MLA's q_layernorm and kv_layernorm)."""

    latent_layernorm_epsilon: float = field(1e-6, range="(0, 1]")
    """RMSNorm epsilon of the query and key/value latents: DeepSeek's models use 1e-6 there
    whatever layernorm_epsilon is."""

    rope_type: Literal["rope", "yarn"] = "yarn"
    """Rotary embeddings: plain ('rope') or YaRN-scaled ('yarn')."""

    rotary_base: int = 10000
    """RoPE base period."""

    rotary_scaling_factor: float = 40.0
    """YaRN: context extension factor."""

    original_max_position_embeddings: int = 4096
    """YaRN: the context the model was pretrained with."""

    beta_fast: float = 32.0
    """YaRN: rotations above which dimensions are extrapolated."""

    beta_slow: float = 1.0
    """YaRN: rotations below which dimensions are interpolated."""

    mscale: float = 1.0
    """YaRN: the rotary embeddings are scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""

    mscale_all_dim: float = 1.0
    """YaRN: the attention softmax scale is multiplied by mscale(factor, mscale_all_dim) squared."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """RMSNorm everywhere."""

    layernorm_epsilon: float = 1e-6
    """RMSNorm epsilon."""

    activation_func: Callable = F.silu
    """SiLU, gated (SwiGLU)."""

    gated_linear_unit: bool = True
    """Gated MLPs and experts."""

    add_bias_linear: bool = False
    """No biases."""

    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "rope"
    """Rotary positions (MLA applies them to the rope part of queries and keys)."""

    share_embeddings_and_output_weights: bool = False
    """Separate input embedding and output layer."""

    hidden_dropout: float = 0.0
    """No dropout."""

    attention_dropout: float = 0.0
    """No attention dropout."""

    init_method_std: float = 0.006
    """Std of the normal weight initialization (DeepSeek-V3's)."""

    num_moe_experts: Optional[int] = 256
    """Routed experts per MoE layer."""

    moe_router_topk: int = 8
    """Routed experts per token."""

    moe_ffn_hidden_size: Optional[int] = 2048
    """Width of each routed expert."""

    moe_shared_expert_intermediate_size: Optional[int] = 2048
    """Width of the shared experts together (number of shared experts x expert width)."""

    moe_router_score_function: Literal["softmax", "sigmoid"] = "sigmoid"
    """Sigmoid router scores, normalized over the chosen experts."""

    moe_router_enable_expert_bias: bool = True
    """A per-expert bias added to the scores for choosing experts only (aux-loss-free balancing)."""

    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update after each global batch."""

    moe_router_num_groups: Optional[int] = 8
    """Expert groups for group-limited routing."""

    moe_router_group_topk: Optional[int] = 4
    """Groups each token's experts are chosen from."""

    moe_router_topk_scaling_factor: Optional[float] = 2.5
    """Routed experts' weights are multiplied by this."""

    moe_router_load_balancing_type: Union[str, List[str]] = "seq_aux_loss"
    """A small per-sequence balancing loss next to the expert bias."""

    moe_aux_loss_coeff: Union[float, List[float]] = 1e-4
    """Weight of the per-sequence balancing loss."""

    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = "fp32"
    """Route in fp32, as the published models do."""

    moe_grouped_gemm: bool = True
    """Run the local experts as one grouped GEMM."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "alltoall"
    """All-to-all token exchange between expert-parallel ranks."""

    moe_layer_freq: Union[int, List[int]] = field(default_factory=lambda: dense_then_moe(3, 61))
    """Per layer 0 (dense MLP) or 1 (MoE): the first layers dense, the rest MoE."""

    bias_activation_fusion: bool = True
    """Fuse the SwiGLU activation (a TorchScript kernel, available everywhere)."""

    def _finalize(self, problems: Problems) -> None:
        super()._finalize(problems)
        p = problems
        # MLATransformerConfig's own checks (the parent post-init run is TransformerConfig's)
        p.check(
            not (self.apply_rope_fusion and self.rope_type != "yarn"),
            "apply_rope_fusion",
            f"the fused MLA rope kernel implements YaRN only, but rope_type={self.rope_type!r}",
            "set model.apply_rope_fusion=False",
        )
        p.check(
            not self.attention_output_gate,
            "attention_output_gate",
            "megatron-core has no output gate for multi-latent attention",
            "set model.attention_output_gate=False",
        )
        p.check(
            not (self.cache_mla_latents and self.apply_rope_fusion),
            "cache_mla_latents",
            "caching MLA latents does not work with the fused rope kernel",
            "set model.apply_rope_fusion=False",
        )
        tp = self.tensor_model_parallel_size
        for name, size in (
            ("q_lora_rank", self.q_lora_rank),
            ("kv_lora_rank", self.kv_lora_rank + self.qk_pos_emb_head_dim),
        ):
            if size is not None and self.multi_latent_attention:
                p.check(
                    size % tp == 0,
                    name,
                    f"the {'query' if name == 'q_lora_rank' else 'key/value (with its rope part)'} latent of "
                    f"{size} does not split over tensor_model_parallel_size={tp}",
                    "choose a TP size that divides it",
                )

    def provide(self, pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                vp_stage: Optional[int] = None):  # fmt: skip
        if self.multi_latent_attention:
            from megatron_bridge.models.layers.latent_attention import mla_without_te

            mla_without_te()
        return super().provide(pre_process, post_process, vp_stage)

    def adjust_layer_spec(self, spec: Any, vp_stage: Optional[int] = None) -> Any:
        """MLA: a local core attention that takes its key and value head sizes; latent norms with
        their own epsilon."""
        from megatron_bridge.models.layers.latent_attention import mla_layer_spec

        if not self.multi_latent_attention:
            return spec
        return mla_layer_spec(spec, self.latent_layernorm_epsilon, self.layernorm_epsilon)


@config_dataclass
class DeepSeekV3ModelProvider(DeepSeekModelProvider):
    """DeepSeek-V3 (and R1) 671B: 61 layers (3 dense), 256 routed experts of which 8 per token
    from 4 of 8 groups, 1 shared expert, YaRN over a 4096-token pretraining context. 671B
    parameters (37B active per token) without the multi-token-prediction layer (14B more),
    which is not built."""

    num_layers: int = 61
    """Transformer layers."""

    hidden_size: int = 7168
    """Model width."""

    ffn_hidden_size: Optional[int] = 18432
    """Width of the dense MLPs of the first layers."""

    num_attention_heads: int = 128
    """Attention heads."""

    vocab_size: Optional[int] = 129280
    """Vocabulary size."""

    seq_length: int = 4096
    """Context length (pretraining)."""


@config_dataclass
class MoonlightModelProvider16B(DeepSeekModelProvider):
    """Moonlight 16B-A3B (Moonshot AI): DeepSeek-V3's architecture with 27 layers (1 dense), full
    query projections, 64 routed experts of which 6 per token (no groups), 2 shared experts, plain
    rope (base 50000). 16.0B parameters, 2.9B active per token."""

    num_layers: int = 27
    """Transformer layers."""

    hidden_size: int = 2048
    """Model width."""

    ffn_hidden_size: Optional[int] = 11264
    """Width of the dense MLP of the first layer."""

    num_attention_heads: int = 16
    """Attention heads."""

    q_lora_rank: Optional[int] = None
    """Queries from one full projection."""

    rope_type: Literal["rope", "yarn"] = "rope"
    """Plain rotary embeddings."""

    rotary_base: int = 50000
    """RoPE base period."""

    mscale_all_dim: float = 0.0
    """No YaRN: no softmax scale adjustment."""

    layernorm_epsilon: float = 1e-5
    """RMSNorm epsilon."""

    init_method_std: float = 0.02
    """Std of the normal weight initialization."""

    num_moe_experts: Optional[int] = 64
    """Routed experts per MoE layer."""

    moe_router_topk: int = 6
    """Routed experts per token."""

    moe_ffn_hidden_size: Optional[int] = 1408
    """Width of each routed expert."""

    moe_shared_expert_intermediate_size: Optional[int] = 2816
    """Two shared experts of 1408."""

    moe_router_num_groups: Optional[int] = None
    """No group-limited routing."""

    moe_router_group_topk: Optional[int] = None
    """No group-limited routing."""

    moe_router_topk_scaling_factor: Optional[float] = 2.446
    """Routed experts' weights are multiplied by this."""

    moe_aux_loss_coeff: Union[float, List[float]] = 1e-3
    """Weight of the per-sequence balancing loss (the published aux_loss_alpha)."""

    moe_layer_freq: Union[int, List[int]] = field(default_factory=lambda: dense_then_moe(1, 27))
    """The first layer dense, the rest MoE."""

    vocab_size: Optional[int] = 163840
    """Vocabulary size."""

    seq_length: int = 8192
    """Context length."""
