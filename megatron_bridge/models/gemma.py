"""Gemma 2 and Gemma 3 (Google): Gemma 3 1B, 4B and 27B (the text decoders), and their Hugging
Face architectures (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`).

Both are built on megatron-core's local layers with the project's layer modules
(`models.layers`):

* RMSNorm with weights stored as `gamma - 1` (`layernorm_zero_centered_gamma`), before and after
  attention and MLP (`output_layernorms`), and on the final hidden states;
* word embeddings times sqrt(hidden_size) (`scale_embeddings`), tied output layer;
* a GeGLU MLP with the tanh approximation of GELU;
* softmax scale `query_pre_attn_scalar ** -0.5` (`softmax_scale`);
* sliding-window layers interleaved with full-attention ones (`window_size`,
  `window_attn_skip_freq`: Gemma 2 alternates, Gemma 3 has five window layers per global one).

Gemma 2 caps attention scores and output logits (`attention_logit_softcap`,
`output_logit_softcap`). Gemma 3 instead normalizes queries and keys per head (`qk_layernorm`)
and rotates the window layers with a RoPE base of their own (`local_rotary_base`, 10000; the
global layers 1e6, with linear position scaling in the 4B and 27B models).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar, Literal, Optional, Tuple, Union

import torch.nn.functional as F

from megatron_bridge.config.base import config_dataclass
from megatron_bridge.config.errors import show
from megatron_bridge.models.attention import window_layers
from megatron_bridge.models.gpt_provider import GPTModelProvider
from megatron_bridge.models.hf.family import HFFamily, causal_window, rope_scaling_of
from megatron_bridge.models.hf.mapping import Copy, Mapped
from megatron_bridge.models.hf.registry import register

GELU_TANH = functools.partial(F.gelu, approximate="tanh")
"""GELU with the tanh approximation (transformers' `gelu_pytorch_tanh`)."""


@config_dataclass
class Gemma2ModelProvider(GPTModelProvider):
    """The Gemma 2 architecture (sizes from the arguments): zero-centered RMSNorm before and after
    attention and MLP, scaled tied embeddings, GeGLU (tanh), sliding-window layers alternating with
    global ones, soft-capped attention scores and logits."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """RMSNorm everywhere."""

    layernorm_zero_centered_gamma: bool = True
    """Norm weights stored as gamma - 1."""

    layernorm_epsilon: float = 1e-6
    """RMSNorm epsilon."""

    output_layernorms: bool = True
    """RMSNorm on the attention and MLP outputs too, before the residual add."""

    activation_func: Callable = GELU_TANH
    """GELU (tanh approximation), gated through gated_linear_unit (GeGLU)."""

    gated_linear_unit: bool = True
    """The MLP's first projection is gated."""

    add_bias_linear: bool = False
    """No biases in linear layers."""

    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "rope"
    """Rotary position embedding."""

    rotary_base: int = 10000
    """RoPE base period."""

    share_embeddings_and_output_weights: bool = True
    """The output layer is the input embedding."""

    scale_embeddings: bool = True
    """Word embeddings times sqrt(hidden_size)."""

    window_size: Optional[Tuple[int, int]] = (4095, 0)
    """Sliding window of the local layers: each token sees itself and the 4095 before it."""

    window_attn_skip_freq: Optional[Union[int, list]] = 2
    """Every second layer attends globally."""

    attention_logit_softcap: Optional[float] = 50.0
    """Attention scores capped at +-50."""

    output_logit_softcap: Optional[float] = 30.0
    """Output logits capped at +-30."""

    hidden_dropout: float = 0.0
    """No dropout."""

    attention_dropout: float = 0.0
    """No attention dropout."""

    transformer_impl: Literal["local", "transformer_engine", "inference_optimized"] = "local"
    """megatron-core's local layers (the soft-capped scores need its unfused core attention)."""

    seq_length: int = 8192
    """Context length."""

    vocab_size: Optional[int] = 256000
    """Vocabulary size (the embedding rows)."""


@config_dataclass
class Gemma3ModelProvider(Gemma2ModelProvider):
    """The Gemma 3 text decoder (sizes from the subclasses): Gemma 2's layers without soft-capping,
    with per-head query/key RMSNorm, five sliding-window layers per global layer, and RoPE base
    10000 on the window layers, 1e6 on the global ones."""

    qk_layernorm: bool = True
    """RMSNorm (zero-centered) over each query and key head."""

    window_attn_skip_freq: Optional[Union[int, list]] = 6
    """Every sixth layer attends globally."""

    rotary_base: int = 1000000
    """RoPE base period of the global layers."""

    local_rotary_base: Optional[int] = 10000
    """RoPE base period of the sliding-window layers."""

    attention_logit_softcap: Optional[float] = None
    """No cap on attention scores."""

    output_logit_softcap: Optional[float] = None
    """No cap on the logits."""

    transformer_impl: Literal["local", "transformer_engine", "inference_optimized"] = "local"
    """megatron-core's local layers (TransformerEngine layers are not checked against this family)."""

    seq_length: int = 32768
    """Context length."""

    vocab_size: Optional[int] = 262144
    """Vocabulary size (the embedding rows)."""


@config_dataclass
class Gemma3ModelProvider1B(Gemma3ModelProvider):
    """Gemma 3 1B (1.00B parameters): one key/value head, a 512-token window, 32k context."""

    num_layers: int = 26
    """Transformer layers."""

    hidden_size: int = 1152
    """Model width."""

    num_attention_heads: int = 4
    """Attention heads."""

    num_query_groups: Optional[int] = 1
    """Key/value heads."""

    kv_channels: Optional[int] = 256
    """Head size."""

    ffn_hidden_size: Optional[int] = 6912
    """MLP width."""

    window_size: Optional[Tuple[int, int]] = (511, 0)
    """Each token of a window layer sees itself and the 511 before it."""


@config_dataclass
class Gemma3ModelProvider4B(Gemma3ModelProvider):
    """Gemma 3 4B, text decoder (3.88B parameters): a 1024-token window, global layers with linear
    RoPE position scaling 8 (128k context), the 262208-row embedding of the released model."""

    num_layers: int = 34
    """Transformer layers."""

    hidden_size: int = 2560
    """Model width."""

    num_attention_heads: int = 8
    """Attention heads."""

    num_query_groups: Optional[int] = 4
    """Key/value heads."""

    kv_channels: Optional[int] = 256
    """Head size."""

    ffn_hidden_size: Optional[int] = 10240
    """MLP width."""

    window_size: Optional[Tuple[int, int]] = (1023, 0)
    """Each token of a window layer sees itself and the 1023 before it."""

    seq_len_interpolation_factor: Optional[float] = 8.0
    """Linear RoPE position scaling of the global layers."""

    seq_length: int = 131072
    """Context length."""

    vocab_size: Optional[int] = 262208
    """Vocabulary size (the embedding rows, image tokens included)."""


@config_dataclass
class Gemma3ModelProvider27B(Gemma3ModelProvider4B):
    """Gemma 3 27B, text decoder (27.0B parameters): head size 128 with query_pre_attn_scalar 168
    (hidden_size / heads) as the softmax scale."""

    num_layers: int = 62
    """Transformer layers."""

    hidden_size: int = 5376
    """Model width."""

    num_attention_heads: int = 32
    """Attention heads."""

    num_query_groups: Optional[int] = 16
    """Key/value heads."""

    kv_channels: Optional[int] = 128
    """Head size."""

    ffn_hidden_size: Optional[int] = 21504
    """MLP width."""

    softmax_scale: Optional[float] = 168**-0.5
    """query_pre_attn_scalar ** -0.5 with query_pre_attn_scalar = 168."""



# ---------------------------------------------------------------------- Hugging Face
def is_gelu_tanh(func: Any) -> bool:
    """Whether `func` is GELU with the tanh approximation (as `GELU_TANH` is)."""
    return isinstance(func, functools.partial) and func.func is F.gelu and not func.args and func.keywords == {
        "approximate": "tanh"
    }


def scalar_of_scale(scale: Any) -> Optional[int]:
    """The whole number whose ** -0.5 is exactly `scale` (transformers' `query_pre_attn_scalar`
    for a softmax scale), or None."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        return None
    scalar = round(scale**-2)
    return scalar if scalar > 0 and scalar**-0.5 == scale else None


def query_pre_attn_scalar(p: Any) -> Optional[int]:
    """`query_pre_attn_scalar` of provider `p`: kv_channels where the softmax scale is
    megatron-core's default (1 / sqrt(kv_channels))."""
    return p.kv_channels if p.softmax_scale is None else scalar_of_scale(p.softmax_scale)


def window_layer_pattern(sliding: list[bool]) -> Optional[Union[int, list[int]]]:
    """`window_attn_skip_freq` for layers with (True) or without a window: None if all have one,
    N if exactly every Nth layer has none, else one 0/1 per layer."""
    if all(sliding):
        return None
    for every in range(2, len(sliding) + 1):
        if all(s == (number % every != 0) for number, s in enumerate(sliding, 1)):
            return every
    return [int(s) for s in sliding]


LAYER_TYPES = ("sliding_attention", "full_attention")
LAYER_FIELDS = {"layernorm_zero_centered_gamma": True, "scale_embeddings": True, "input_layernorms": True,
                "output_layernorms": True}  # fmt: skip


class GemmaFamily(HFFamily):
    """What Gemma 2 and 3 share: `hidden_activation`, `query_pre_attn_scalar`, four norms per
    layer (`input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`,
    `post_feedforward_layernorm`), sliding windows by `layer_types`, `final_logit_softcapping`."""

    nullable_fields = (*HFFamily.nullable_fields, "window_attn_skip_freq", "local_rotary_base",
                       "seq_len_interpolation_factor", "attention_logit_softcap", "output_logit_softcap")  # fmt: skip
    window_pattern: ClassVar[int] = 2
    """Every Nth layer is global where config.json has no `layer_types`."""

    window_pattern_field: ClassVar[Optional[str]] = None
    """The config.json field overriding `window_pattern`, if the architecture reads one."""

    default_softcaps: ClassVar[tuple[Optional[float], Optional[float]]] = (None, None)
    """transformers' defaults of (attn_logit_softcapping, final_logit_softcapping)."""

    def read_activation(self, read):
        read.used("hidden_act")  # transformers' Gemma 2 and 3 read hidden_activation only
        act = read.hf.get("hidden_activation", "gelu_pytorch_tanh")
        read.used("hidden_activation")
        if act != "gelu_pytorch_tanh":
            read.refuse("hidden_activation", f"{show(act)} is not converted (gelu_pytorch_tanh is)", "")
        return {"activation_func": GELU_TANH}

    def read_decoder(self, read):
        kw = super().read_decoder(read)
        kw["share_embeddings_and_output_weights"] = read.bool("tie_word_embeddings", default=True)
        return {**kw, **LAYER_FIELDS}

    def read_attention(self, read):
        kw = super().read_attention(read)
        read.expect("use_bidirectional_attention", False, "causal language models are converted")
        scalar = read.float("query_pre_attn_scalar", default=256.0)
        if not scalar > 0:
            read.refuse("query_pre_attn_scalar", f"{show(scalar)} is not positive", "")
        else:
            kw["softmax_scale"] = scalar**-0.5  # as transformers computes it
        attention_cap, output_cap = self.default_softcaps
        for field, default, name in (("attn_logit_softcapping", attention_cap, "attention_logit_softcap"),
                                     ("final_logit_softcapping", output_cap, "output_logit_softcap")):  # fmt: skip
            read.used(field)
            cap = read.hf.get(field, default)
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
                read.refuse(field, f"{show(cap)} is not a positive number or null", "")
                cap = None
            kw[name] = None if cap is None else float(cap)
        return kw

    def read_window(self, read):
        hf = read.hf
        layers = hf.get("num_hidden_layers")
        types = hf.get("layer_types")
        read.used("layer_types")
        if self.window_pattern_field is not None:
            read.used(self.window_pattern_field)  # layer_types, where given, wins (as in transformers)
        if types is None:
            every = self.window_pattern
            if self.window_pattern_field is not None:
                every = read.int(self.window_pattern_field, default=every, required=False)
            if not isinstance(layers, int) or not every:
                return {}
            types = [LAYER_TYPES[int(n % every == 0)] for n in range(1, layers + 1)]
        if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types) or len(types) != layers:
            read.refuse("layer_types", f"{show(types)} is not one of {LAYER_TYPES} per layer", "")
            return {}
        sliding = [t == "sliding_attention" for t in types]
        window = read.int("sliding_window", default=None, required=False)
        if not any(sliding):
            return {"window_size": None, "window_attn_skip_freq": None}
        if not window:
            read.refuse("sliding_window", f"{show(window)}: layer_types has sliding_attention layers", "")
            return {}
        return {"window_size": (window - 1, 0), "window_attn_skip_freq": window_layer_pattern(sliding)}

    def read_layer_types(self, read):
        """Read with the window (`read_window`)."""

    def architecture_of(self, hf):
        return dataclasses.replace(super().architecture_of(hf), tied=bool(hf.get("tie_word_embeddings", True)))

    def settings(self):
        return {
            **super().settings(),
            **LAYER_FIELDS,
            "activation_func": is_gelu_tanh,
            "softmax_scale": lambda scale: scale is None or scalar_of_scale(scale) is not None,
            "window_size": causal_window,
            "window_attn_skip_freq": lambda value: True,
            "output_logit_softcap": lambda value: True,
        }

    def hf_config(self, p, dtype):
        cfg = super().hf_config(p, dtype)
        del cfg["hidden_act"]
        cfg.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=query_pre_attn_scalar(p),
            sliding_window=p.window_size[0] + 1 if p.window_size is not None else None,
            layer_types=[LAYER_TYPES[0] if window else LAYER_TYPES[1] for window in window_layers(p)],
            attention_bias=False,
            final_logit_softcapping=p.output_logit_softcap,
            attn_logit_softcapping=p.attention_logit_softcap,
        )
        return cfg

    def norm_tensors(self, a, L):
        p = f"model.layers.{L}"
        return {
            "input_layernorm.weight": Mapped((a.hidden,), Copy(f"{p}.input_layernorm.weight")),
            "self_attn_bda.norm.weight": Mapped((a.hidden,), Copy(f"{p}.post_attention_layernorm.weight")),
            "pre_mlp_layernorm.weight": Mapped((a.hidden,), Copy(f"{p}.pre_feedforward_layernorm.weight")),
            "mlp_bda.norm.weight": Mapped((a.hidden,), Copy(f"{p}.post_feedforward_layernorm.weight")),
        }


@register
class Gemma2Family(GemmaFamily):
    """`Gemma2ForCausalLM`: soft-capped attention scores and logits, alternating windows."""

    architecture = "Gemma2ForCausalLM"
    model_type = "gemma2"
    provider = Gemma2ModelProvider
    default_softcaps = (50.0, 30.0)

    def settings(self):
        return {**super().settings(), "qk_layernorm": False, "attention_logit_softcap": lambda value: True}


@register
class Gemma3Family(GemmaFamily):
    """`Gemma3ForCausalLM` (`gemma3_text`): per-head `q_norm` / `k_norm`, RoPE per layer type."""

    architecture = "Gemma3ForCausalLM"
    model_type = "gemma3_text"
    provider = Gemma3ModelProvider
    window_pattern = 6
    window_pattern_field = "sliding_window_pattern"

    def provider_fields(self, read):
        kw = super().provider_fields(read)
        if kw.get("window_size", 0) is None:
            kw["local_rotary_base"] = None  # no window layers to rotate with it
        return {**kw, "qk_layernorm": True}

    def read_attention(self, read):
        kw = super().read_attention(read)
        if kw.get("attention_logit_softcap") is not None:
            read.refuse("attn_logit_softcapping", f"{kw['attention_logit_softcap']}: transformers' Gemma 3 does not "
                        "apply it, so the converted model would differ from the one it computes", "set it to null")  # fmt: skip
        kw.pop("attention_logit_softcap", None)
        return kw

    def read_rope(self, read):
        """RoPE per layer type: `rope_parameters.{full,sliding}_attention` (transformers 5), or
        `rope_theta` and `rope_scaling` (global layers) and `rope_local_base_freq` (transformers 4).
        The global layers take default or linear scaling, the window layers none."""
        hf = read.hf
        for key in ("rope_parameters", "rope_theta", "rope_scaling", "rope_local_base_freq"):
            read.used(key)
        params = hf.get("rope_parameters")
        if isinstance(params, dict) and set(params) & set(LAYER_TYPES):
            full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
            fields = ("rope_parameters.full_attention.rope_theta", "rope_parameters.sliding_attention.rope_theta")
            full_type, local_type = "rope_parameters.full_attention.rope_type", "rope_parameters.sliding_attention.rope_type"
        elif params:
            read.refuse("rope_parameters", f"{show(params)}: Gemma 3 sets RoPE per layer type (full_attention, "
                        "sliding_attention)", "")  # fmt: skip
            return {}
        else:
            scaling, _, _ = rope_scaling_of(read)
            full = {**scaling, "rope_theta": hf.get("rope_theta", 1_000_000.0)}
            local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
            fields, full_type, local_type = ("rope_theta", "rope_local_base_freq"), "rope_scaling.rope_type", ""
        out: dict[str, Any] = {}
        for params_of, field, name in ((full, fields[0], "rotary_base"), (local, fields[1], "local_rotary_base")):
            theta = params_of.get("rope_theta")
            if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0 or float(theta) != int(theta):
                read.refuse(field, f"{show(theta)} is not a positive whole number", "")
            else:
                out[name] = int(theta)
        kind = full.get("rope_type", full.get("type", "default"))
        factor = full.get("factor")
        if kind == "linear" and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
            read.refuse(full_type.replace("rope_type", "factor"), f"{show(factor)} is not a positive number", "")
        elif kind == "linear":
            out["seq_len_interpolation_factor"] = float(factor)
        elif kind != "default":
            read.refuse(full_type, f"{kind!r} is not implemented for the global layers (default and linear are)", "")
        local_kind = local.get("rope_type", local.get("type", "default"))
        if local_kind != "default":
            read.refuse(local_type, f"{local_kind!r} is not implemented for the sliding-window layers (default is)", "")
        return out

    def settings(self):
        return {
            **super().settings(),
            "qk_layernorm": True,
            "qk_layernorm_per_head": True,
            "rope_scaling": False,
            "local_rotary_base": lambda value: value is None or value > 0,
        }

    def hf_config(self, p, dtype):
        cfg = super().hf_config(p, dtype)
        cfg["rope_local_base_freq"] = float(p.local_rotary_base or 10000)
        cfg["use_bidirectional_attention"] = False
        return cfg

    def attention_tensors(self, a, L):
        attn = f"model.layers.{L}.self_attn"
        return {
            **super().attention_tensors(a, L),
            "self_attention.q_layernorm.weight": Mapped((a.head_dim,), Copy(f"{attn}.q_norm.weight")),
            "self_attention.k_layernorm.weight": Mapped((a.head_dim,), Copy(f"{attn}.k_norm.weight")),
        }
