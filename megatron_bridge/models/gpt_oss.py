"""GPT-OSS (OpenAI): gpt-oss-20b and gpt-oss-120b, and their Hugging Face architecture
(`GptOssForCausalLM`).

A mixture-of-experts transformer with pre-RMSNorm layers and, each as megatron-core computes it:

* attention with biases on every projection and a learned sink per head (a logit added to each
  softmax row and dropped afterwards: `softmax_type='learnable'`, the `softmax_offset`
  parameter), on layers that alternate a sliding window of 128 tokens with full causal
  attention (`window_size`, `window_attn_skip_freq`);
* YaRN rotary embeddings (`position_embedding_type='yarn'`), context 4096 extended 32 times;
* a router with a bias, softmax over the top-k logits;
* experts with biases and a clamped SwiGLU: `(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)` with
  `g = clamp(gate, max=7)` (`activation_func=quick_gelu`, `glu_linear_offset=1`,
  `activation_func_clamp_value=7`, the bias added before the clamp, so unfused).

The Hugging Face files keep each layer's experts stacked: `mlp.experts.gate_up_proj`
[experts, hidden, 2 x ffn] with gate and up interleaved along the last dimension, and
`down_proj` [experts, ffn, hidden], both [in, out] (`models.hf.stacked`). The published weights
are MXFP4-quantized and are refused: they must be dequantized first.
"""

from __future__ import annotations

from typing import Callable, List, Literal, Optional, Tuple, Union

from megatron_bridge.config.base import config_dataclass
from megatron_bridge.models.activations import quick_gelu
from megatron_bridge.models.gpt_provider import GPTModelProvider
from megatron_bridge.models.hf.family import (
    HFFamily, causal_window, has_experts, read_renormalized_topk, read_rope_theta, rope_scaling_of, scalar,
)  # fmt: skip
from megatron_bridge.models.hf.mapping import Copy, Mapped
from megatron_bridge.models.hf.registry import register
from megatron_bridge.models.hf.stacked import ExpertSlice
from megatron_bridge.models.hf.yarn import no_yarn, read_yarn, yarn_settings

SWIGLU_ALPHA = 1.702
"""The sigmoid gain of GPT-OSS's gate: quick_gelu's constant."""


@config_dataclass
class GptOssModelProvider(GPTModelProvider):
    """GPT-OSS: 64 query heads and 8 key/value heads of 64 dimensions over a 2880-wide model,
    experts 2880 wide with 4 chosen per token, a 201088-token vocabulary (o200k_harmony)."""

    num_attention_heads: int = 64
    """Attention heads."""

    num_query_groups: Optional[int] = 8
    """Key/value heads."""

    kv_channels: Optional[int] = 64
    """Dimensions per head (64 heads x 64 = 4096, wider than the model)."""

    hidden_size: int = 2880
    """Model width."""

    ffn_hidden_size: Optional[int] = 2880
    """Width of a dense MLP (unused: every layer is MoE)."""

    vocab_size: Optional[int] = 201088
    """Vocabulary size."""

    seq_length: int = 131072
    """Context length (YaRN over a 4096-token pretraining context)."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """RMSNorm before attention and the experts."""

    layernorm_epsilon: float = 1e-5
    """RMSNorm epsilon."""

    gated_linear_unit: bool = True
    """The experts' first projection is gated."""

    activation_func: Callable = quick_gelu
    """The gate's activation: g * sigmoid(1.702 g)."""

    activation_func_clamp_value: Optional[float] = 7.0
    """The gate is clamped to at most 7, the up projection to [-7, 7] (the published swiglu_limit)."""

    glu_linear_offset: float = 1.0
    """The up projection enters the product as (up + 1)."""

    add_bias_linear: bool = True
    """Biases on the attention projections, the router and the experts."""

    bias_activation_fusion: bool = False
    """Unfused: megatron-core's fused gated activation would clamp before adding the bias."""

    bias_dropout_fusion: bool = False
    """Unfused (TransformerEngine's grouped experts do not fuse it with biases)."""

    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "learnable"
    """Attention sinks: a learned logit per head in every softmax row."""

    window_size: Optional[Tuple[int, int]] = (127, 0)
    """Sliding window of 128 tokens: each token sees itself and the 127 before it."""

    window_attn_skip_freq: Optional[Union[int, List[int]]] = 2
    """Every second layer (2, 4, ...) attends over the whole causal context."""

    position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = "yarn"
    """YaRN rotary embeddings."""

    rotary_base: int = 150000
    """RoPE base period."""

    yarn_rotary_scaling_factor: float = 32.0
    """The 4096-token context extended 32 times."""

    yarn_original_max_position_embeddings: int = 4096
    """The pretraining context."""

    yarn_correction_range_round_to_int: bool = False
    """The ramp's bounds are not rounded (transformers' truncate=False)."""

    share_embeddings_and_output_weights: bool = False
    """Separate input embedding and output layer."""

    hidden_dropout: float = 0.0
    """No dropout."""

    attention_dropout: float = 0.0
    """No attention dropout."""

    init_method_std: float = 0.02
    """Std of the normal weight initialization."""

    moe_ffn_hidden_size: Optional[int] = 2880
    """Width of each expert's MLP."""

    moe_router_topk: int = 4
    """Experts each token is routed to (softmax over their 4 logits)."""

    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    """Load balancing through an auxiliary loss."""

    moe_aux_loss_coeff: Union[float, List[float]] = 0.9
    """Weight of the load-balancing loss (the published router_aux_loss_coef)."""

    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = "fp32"
    """Route in fp32."""

    moe_grouped_gemm: bool = True
    """Run the local experts as one grouped GEMM (TransformerEngine's, which has biases)."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "alltoall"
    """All-to-all token exchange between expert-parallel ranks."""


@config_dataclass
class GptOssModelProvider20B(GptOssModelProvider):
    """gpt-oss-20b (20.9B parameters in total; 3.6B active per token, the input embedding not counted): 24 layers, 32 experts."""

    num_layers: int = 24
    """Transformer layers."""

    num_moe_experts: Optional[int] = 32
    """Experts per MoE layer."""


@config_dataclass
class GptOssModelProvider120B(GptOssModelProvider):
    """gpt-oss-120b (116.8B parameters in total; 5.1B active per token, the input embedding not counted): 36 layers, 128 experts."""

    num_layers: int = 36
    """Transformer layers."""

    num_moe_experts: Optional[int] = 128
    """Experts per MoE layer."""


# ---------------------------------------------------------------------- Hugging Face
SLIDING, FULL = "sliding_attention", "full_attention"


def window_pattern(layer_types: list) -> Union[int, List[int], None]:
    """`window_attn_skip_freq` for config.json's `layer_types` (sliding layers have the window):
    None when every layer has it, 2 for GPT-OSS's alternation (sliding first), else one 0/1 per
    layer."""
    flags = [int(t == SLIDING) for t in layer_types]
    if all(flags):
        return None
    if flags == [int(i % 2 == 0) for i in range(len(flags))]:
        return 2
    return flags


def windowed_layers(freq: Union[int, List[int], None], num_layers: int) -> list[bool]:
    """Which layers have the window, as megatron-core decides it (layers numbered from 1)."""
    if freq is None:
        return [True] * num_layers
    if isinstance(freq, int):
        return [(i + 1) % freq != 0 for i in range(num_layers)]
    return [bool(x) for x in freq]


@register
class GptOssFamily(HFFamily):
    """`GptOssForCausalLM`: attention with biases and sinks (`self_attn.sinks`), the router
    `mlp.router` with a bias, stacked experts `mlp.experts.{gate_up_proj,down_proj}[_bias]`."""

    architecture = "GptOssForCausalLM"
    model_type = "gpt_oss"
    provider = GptOssModelProvider
    nullable_fields = (*HFFamily.nullable_fields, "window_attn_skip_freq", "activation_func_clamp_value", "yarn_mscale",
                       "yarn_mscale_all_dim")
    adapter_modules = {
        "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attention.linear_proj": ("self_attn.o_proj",),
    }

    # ------------------------------------------------------------------ config.json -> provider
    def read_decoder(self, read):
        kw = super().read_decoder(read)
        kw.update(
            activation_func=quick_gelu,
            gated_linear_unit=True,
            glu_linear_offset=1.0,
            add_bias_linear=True,
            softmax_type="learnable",
        )
        return kw

    def read_quantization(self, read):
        quantization = read.hf.get("quantization_config")
        if quantization is not None:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            read.refuse(
                "quantization_config",
                f"{method!r}: quantized expert weights are not converted",
                "dequantize to bf16 first (transformers: from_pretrained(..., quantization_config=Mxfp4Config("
                "dequantize=True)), then save_pretrained) and convert that directory",
            )

    def read_attention(self, read):
        read.expect("attention_bias", True, "biases on every projection are converted")
        return {}

    def read_window(self, read):
        window = read.int("sliding_window", default=None, required=False)
        layers = read.hf.get("num_hidden_layers") or 0
        layer_types = read.hf.get("layer_types")
        read.used("layer_types")
        if layer_types is None:  # transformers' default: sliding first, then alternating
            layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
        if not isinstance(layer_types, list) or any(t not in (SLIDING, FULL) for t in layer_types):
            read.refuse("layer_types", f"{layer_types!r}: only {SLIDING!r} and {FULL!r} layers exist", "")
            return {}
        if len(layer_types) != layers:
            read.refuse("layer_types", f"lists {len(layer_types)} layers, num_hidden_layers={layers}", "fix config.json")
            return {}
        if window is None or SLIDING not in layer_types:
            return {"window_size": None, "window_attn_skip_freq": None}
        if window < 1:
            read.refuse("sliding_window", f"{window} is not a positive window", "")
            return {}
        return {"window_size": (window - 1, 0), "window_attn_skip_freq": window_pattern(layer_types)}

    def read_layer_types(self, read):
        """Read with the window (`read_window`)."""

    def read_rope(self, read):
        out = read_rope_theta(read)
        scaling, field, kind = rope_scaling_of(read)
        if kind == "yarn":
            return {**out, **read_yarn(read, scaling, field)}
        if kind != "default":
            read.refuse(f"{field}.rope_type", f"{kind!r} is not implemented (default and yarn are)", "")
        return {**out, **no_yarn(), "position_embedding_type": "rope"}  # not the provider's YaRN defaults

    def read_mlp(self, read, kw):
        alpha = read.float("swiglu_alpha", default=SWIGLU_ALPHA)
        if alpha != SWIGLU_ALPHA:
            read.refuse("swiglu_alpha", f"{alpha} (megatron-core's quick_gelu gate has the gain {SWIGLU_ALPHA})", "")
        limit = read.hf.get("swiglu_limit", 7.0)
        read.used("swiglu_limit")
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
            read.refuse("swiglu_limit", f"{limit!r} is not a positive clamp", "fix config.json")
        return dict(
            num_moe_experts=read.int("num_local_experts"),
            moe_router_topk=read_renormalized_topk(read),  # softmax over the chosen experts' logits
            moe_ffn_hidden_size=kw["ffn_hidden_size"],
            moe_aux_loss_coeff=read.float("router_aux_loss_coef", default=0.9),
            activation_func_clamp_value=float(limit) if isinstance(limit, (int, float)) else None,
        )

    # ------------------------------------------------------------------ provider -> config.json
    def settings(self):
        return {
            **super().settings(),
            "activation_func": lambda f: getattr(f, "__name__", "") == "quick_gelu",
            "activation_func_clamp_value": lambda v: v is not None and v > 0,
            "glu_linear_offset": 1.0,
            "add_bias_linear": True,
            "add_qkv_bias": lambda v: True,  # add_bias_linear gives the projections their biases
            "softmax_type": "learnable",
            "position_embedding_type": lambda v: v in ("rope", "yarn"),
            "rope_scaling": False,
            "seq_len_interpolation_factor": None,
            "window_size": causal_window,
            "window_attn_skip_freq": lambda v: True,  # any pattern is a layer_types list
            "num_moe_experts": has_experts,
            "moe_layer_freq": 1,
            "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": False,
            "moe_router_topk_scaling_factor": None,
            "moe_router_num_groups": None,
            "moe_router_enable_expert_bias": False,
        }

    def hf_config(self, p, dtype):
        cfg = super().hf_config(p, dtype)
        windowed = windowed_layers(p.window_attn_skip_freq, p.num_layers)
        cfg.update(
            intermediate_size=p.moe_ffn_hidden_size,
            num_local_experts=p.num_moe_experts,
            num_experts_per_tok=p.moe_router_topk,
            router_aux_loss_coef=scalar(p.moe_aux_loss_coeff),
            swiglu_limit=p.activation_func_clamp_value,
            attention_bias=True,
            sliding_window=p.window_size[0] + 1 if p.window_size is not None else None,
            layer_types=[SLIDING if w and p.window_size is not None else FULL for w in windowed],
        )
        if p.position_embedding_type == "yarn":
            cfg["rope_scaling"] = yarn_settings(p)
        return cfg

    # ------------------------------------------------------------------ weights
    def experts_of(self, hf):
        return {"num_experts": hf.get("num_local_experts") or 0, "moe_ffn": hf.get("intermediate_size", 0)}

    def attention_tensors(self, a, L):
        attn = f"model.layers.{L}.self_attn"
        return {
            **super().attention_tensors(a, L),
            "self_attention.linear_qkv.bias": Mapped((self.qkv_rows(a),), self.qkv(a, L, "bias")),
            "self_attention.linear_proj.bias": Mapped((a.hidden,), Copy(f"{attn}.o_proj.bias")),
            "self_attention.core_attention.softmax_offset": Mapped((a.heads,), Copy(f"{attn}.sinks")),
        }

    def mlp_tensors(self, a, L):
        router = f"model.layers.{L}.mlp.router"
        return {
            "mlp.router.weight": Mapped((a.num_experts, a.hidden), Copy(f"{router}.weight")),
            "mlp.router.bias": Mapped((a.num_experts,), Copy(f"{router}.bias")),
        }

    def expert_tensors(self, a, L, E):
        experts, h, f, n = f"model.layers.{L}.mlp.experts", a.hidden, a.moe_ffn, a.num_experts
        return {
            "linear_fc1.weight": Mapped(
                (2 * f, h), ExpertSlice(f"{experts}.gate_up_proj", E, n, transposed=True, interleaved=True, gated=True)
            ),
            "linear_fc1.bias": Mapped((2 * f,), ExpertSlice(f"{experts}.gate_up_proj_bias", E, n, interleaved=True, gated=True)),
            "linear_fc2.weight": Mapped((h, f), ExpertSlice(f"{experts}.down_proj", E, n, transposed=True)),
            "linear_fc2.bias": Mapped((h,), ExpertSlice(f"{experts}.down_proj_bias", E, n)),
        }
