"""Hugging Face `config.json` <-> model providers.

`provider_from_hf` reads a config.json and returns the family's provider with every
architecture field set from it. A setting the providers cannot reproduce (an architecture we do
not convert, a rope type we do not implement, per-layer sliding windows, biases we do not have,
quantized weights) is a `ConfigValidationError` naming the field: converting such a model would
silently change what it computes. `hf_config_from_provider` writes the inverse.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from megatron_bridge.config.errors import ConfigValidationError, Problems, show
from megatron_bridge.models.hf.files import config_path, read_json

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    """A Hugging Face architecture we convert, and the provider class that builds it."""

    architecture: str
    model_type: str
    provider: str
    moe: bool = False


FAMILIES = (
    Family("LlamaForCausalLM", "llama", "LlamaModelProvider"),
    Family("MistralForCausalLM", "mistral", "MistralModelProvider"),
    Family("MixtralForCausalLM", "mixtral", "MixtralModelProvider", moe=True),
    Family("Qwen2ForCausalLM", "qwen2", "Qwen2ModelProvider"),
    Family("Qwen3ForCausalLM", "qwen3", "Qwen3ModelProvider"),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoEModelProvider", moe=True),
)
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}

# Llama 3.1 rope scaling: megatron-core implements it with these constants.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

UNUSED_OK = frozenset(
    {
        "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
        "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "pretraining_tp", "output_router_logits",
        "return_dict", "output_hidden_states", "output_attentions", "tie_word_embeddings", "max_window_layers",
        "id2label", "label2id", "tokenizer_class", "use_bfloat16", "is_decoder", "is_encoder_decoder",
    }
)  # fmt: skip
"""Fields that do not change the weights or what the model computes."""


def read_hf_config(path: str, label: str = "") -> dict:
    """The config.json of the directory `path` (or the file itself) as a dict."""
    file = config_path(path)
    try:
        data = read_json(file)
    except ValueError as exc:
        raise ConfigValidationError(_problem(label or file, str(exc), "point it at a Hugging Face model directory")) from None
    if not isinstance(data, dict):
        raise ConfigValidationError(_problem(label or file, f"{file} does not hold a JSON object", "fix the file"))
    return data


def _problem(path: str, message: str, fix: str):
    from megatron_bridge.config.errors import ConfigProblem

    return ConfigProblem(path, message, fix)


def family_of(hf: dict, problems: Problems, where: str = "config.json") -> Optional[Family]:
    """The family of a config.json, or None (with a problem naming the `architectures` field)."""
    names = hf.get("architectures")
    supported = ", ".join(f.architecture for f in FAMILIES)
    if names is None and hf.get("model_type") in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[hf["model_type"]]
    if not isinstance(names, list) or len(names) != 1 or names[0] not in BY_ARCHITECTURE:
        problems.add(
            "",
            f"{where}: architectures={show(names)} is not supported",
            f"convert one of: {supported}",
        )
        return None
    return BY_ARCHITECTURE[names[0]]


def provider_from_hf(path: str, label: str = ""):
    """The family provider for the Hugging Face directory (or config.json) `path`, every
    architecture field set explicitly; raises `ConfigValidationError` naming what cannot be
    converted."""
    hf = read_hf_config(path, label)
    problems = Problems(label or "from_hf")
    provider = provider_from_hf_config(hf, problems, where=config_path(path))
    problems.raise_if_any()
    return provider


def provider_from_hf_config(hf: dict, problems: Problems, where: str = "config.json"):
    """`provider_from_hf` on a parsed config.json; problems go into `problems` (None if any)."""
    import torch.nn.functional as F

    from megatron_bridge import models

    family = family_of(hf, problems, where)
    if family is None:
        return None
    start = len(problems)
    read = _Reader(hf, problems, where)
    heads = read.int("num_attention_heads")
    hidden = read.int("hidden_size")
    vocab = read.int("vocab_size")
    groups = read.int("num_key_value_heads", default=heads)
    head_dim = read.int("head_dim", default=hidden // heads if hidden and heads else None)
    kw: dict[str, Any] = dict(
        num_layers=read.int("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=read.int("intermediate_size"),
        vocab_size=vocab,
        make_vocab_size_divisible_by=_vocab_multiple(vocab) if vocab else 128,
        seq_length=read.int("max_position_embeddings", default=4096),
        layernorm_epsilon=read.float("rms_norm_eps", default=1e-6),
        share_embeddings_and_output_weights=read.bool("tie_word_embeddings", default=False),
        attention_dropout=read.float("attention_dropout", default=0.0),
        init_method_std=read.float("initializer_range", default=0.02),
        activation_func=F.silu,
        position_embedding_type="rope",
    )
    read.expect("hidden_act", "silu", "only SiLU-gated MLPs are converted")
    read.expect("mlp_bias", False, "the providers have no MLP biases")
    read.expect("partial_rotary_factor", 1.0, "rotary embeddings over the whole head are converted")
    if "quantization_config" in hf:
        read.refuse("quantization_config", "quantized weights are not converted", "start from unquantized weights")
    kw.update(_rope(read))
    if family.model_type in ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe"):
        read.expect("attention_bias", False, "attention biases are only converted for Qwen2 (query/key/value)")
    if family.model_type in ("mistral", "mixtral"):
        window = read.int("sliding_window", default=None, required=False)
        if window is not None:
            kw["window_size"] = (window - 1, 0)  # the token itself and the window-1 before it
        else:
            kw["window_size"] = None
    else:
        read.expect("use_sliding_window", False, "per-layer sliding windows are not implemented for this family")
        read.used("sliding_window")  # without use_sliding_window, transformers ignores it too
    layer_types = hf.get("layer_types")
    read.used("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        read.refuse("layer_types", f"{show(layer_types)}: per-layer attention types are not implemented", "")
    if family.model_type == "qwen2":
        kw["add_qkv_bias"] = True
    if family.model_type in ("qwen3", "qwen3_moe"):
        kw["qk_layernorm"] = True
    if family.model_type == "mixtral":
        ffn = kw["ffn_hidden_size"]
        kw.update(
            num_moe_experts=read.int("num_local_experts"),
            moe_router_topk=read.int("num_experts_per_tok"),
            moe_ffn_hidden_size=ffn,
            moe_aux_loss_coeff=read.float("router_aux_loss_coef", default=0.02),
        )
        jitter = read.float("router_jitter_noise", default=0.0)
        kw["moe_input_jitter_eps"] = jitter or None
    if family.model_type == "qwen3_moe":
        experts = "num_experts" if "num_experts" in hf else "num_local_experts"  # transformers 4 / 5
        kw.update(
            num_moe_experts=read.int(experts),
            moe_router_topk=read.int("num_experts_per_tok"),
            moe_ffn_hidden_size=read.int("moe_intermediate_size"),
            moe_aux_loss_coeff=read.float("router_aux_loss_coef", default=1e-3),
            # normalized top-k: softmax over the chosen experts; otherwise over all of them
            moe_router_pre_softmax=not read.bool("norm_topk_prob", default=False),
        )
        read.expect("decoder_sparse_step", 1, "every layer must be a mixture-of-experts layer")
        read.expect("mlp_only_layers", [], "every layer must be a mixture-of-experts layer")
    read.report_unused()
    if len(problems) > start:
        return None
    provider_cls = getattr(models, family.provider)
    return provider_cls(**{k: v for k, v in kw.items() if v is not None or k in ("window_size", "moe_input_jitter_eps")})


def _vocab_multiple(vocab: int) -> int:
    """The largest power of two up to 128 dividing `vocab`: no padding rows at TP=1, so the
    logits (and the loss) are those of the Hugging Face model."""
    multiple = 128
    while vocab % multiple:
        multiple //= 2
    return multiple


def _rope(read: "_Reader") -> dict[str, Any]:
    """rotary_base and scaling from `rope_theta`/`rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5)."""
    hf = read.hf
    params = hf.get("rope_parameters") or {}
    read.used("rope_parameters")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    read.used("rope_theta")
    out: dict[str, Any] = {}
    if not isinstance(theta, (int, float)) or float(theta) != int(theta) or theta <= 0:
        read.refuse("rope_theta", f"{show(theta)} is not a positive whole number", "")
    else:
        out["rotary_base"] = int(theta)
    scaling = hf.get("rope_scaling")
    read.used("rope_scaling")
    field = "rope_scaling"
    if not scaling and params.get("rope_type", "default") != "default":
        scaling, field = params, "rope_parameters"
    if not scaling:
        return out
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return out
    if kind == "linear":
        out["seq_len_interpolation_factor"] = float(scaling["factor"])
    elif kind == "llama3":
        for key, expected in LLAMA3_ROPE.items():
            if float(scaling.get(key, expected)) != expected:
                read.refuse(f"{field}.{key}", f"{scaling.get(key)!r} (megatron-core implements {expected})", "")
        out.update(rope_scaling=True, rope_scaling_factor=float(scaling.get("factor", 8.0)))
    else:
        read.refuse(f"{field}.rope_type", f"{kind!r} is not implemented (default, linear and llama3 are)", "")
    return out


class _Reader:
    """Typed access to config.json fields, recording what was used and what is wrong."""

    def __init__(self, hf: dict, problems: Problems, where: str):
        self.hf, self.problems, self.where = hf, problems, where
        self.seen: set[str] = set()

    def used(self, key: str) -> None:
        self.seen.add(key)

    def refuse(self, field: str, why: str, fix: str) -> None:
        self.problems.add("", f"{self.where}: field {field} = {why}", fix or "convert a model without this setting")

    def _get(self, key: str, default: Any, required: bool) -> Any:
        self.seen.add(key)
        if key in self.hf and self.hf[key] is not None:
            return self.hf[key]
        if required and default is None:
            self.problems.add("", f"{self.where}: field {key} is missing", f"add {key} to config.json")
        return default

    def int(self, key: str, default: Any = None, required: bool = True) -> Optional[int]:
        value = self._get(key, default, required)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            self.refuse(key, f"{show(value)} is not a non-negative integer", "fix config.json")
            return None
        return value

    def float(self, key: str, default: float) -> float:
        value = self._get(key, default, False)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.refuse(key, f"{show(value)} is not a number", "fix config.json")
            return default
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self._get(key, default, False)
        if not isinstance(value, bool):
            self.refuse(key, f"{show(value)} is not true or false", "fix config.json")
            return default
        return value

    def expect(self, key: str, expected: Any, why: str) -> None:
        """Refuse any value of `key` other than `expected` (absent counts as expected)."""
        self.seen.add(key)
        value = self.hf.get(key, expected)
        if value is not None and value != expected:
            self.problems.add("", f"{self.where}: field {key} = {show(value)} cannot be converted ({why})",
                              f"convert a model with {key}={expected!r}")  # fmt: skip

    def report_unused(self) -> None:
        unused = sorted(k for k in self.hf if k not in self.seen and k not in UNUSED_OK)
        if unused:
            logger.info("%s: fields not used by the conversion: %s", self.where, ", ".join(unused))


# ---------------------------------------------------------------------- provider -> config.json
def family_of_provider(provider: Any, problems: Problems) -> Optional[Family]:
    """The Hugging Face family that computes what `provider` computes, or None (with a problem
    naming the setting no family has)."""
    from megatron_bridge.models.mistral import MistralModelProvider

    p = provider
    checks = (
        (p.normalization == "RMSNorm", "normalization", p.normalization),
        (p.gated_linear_unit, "gated_linear_unit", p.gated_linear_unit),
        (getattr(p.activation_func, "__name__", "") == "silu", "activation_func", p.activation_func),
        (p.position_embedding_type == "rope", "position_embedding_type", p.position_embedding_type),
        (not p.add_bias_linear, "add_bias_linear", p.add_bias_linear),
        (p.rotary_percent == 1.0, "rotary_percent", p.rotary_percent),
        (not (p.add_qkv_bias and (p.qk_layernorm or p.num_moe_experts)), "add_qkv_bias", p.add_qkv_bias),
        (p.window_size is None or (p.window_size[1] == 0 and not p.qk_layernorm and not p.add_qkv_bias), "window_size", p.window_size),
        (p.moe_shared_expert_intermediate_size is None, "moe_shared_expert_intermediate_size", p.moe_shared_expert_intermediate_size),
    )  # fmt: skip
    ok = True
    for good, name, value in checks:
        if not good:
            problems.add(
                f"model.{name}",
                f"{show(value)} has no Hugging Face counterpart among {', '.join(f.architecture for f in FAMILIES)}",
                "export a Llama/Mistral/Mixtral/Qwen-style model",
            )
            ok = False
    if not ok:
        return None
    if p.num_moe_experts:
        return BY_MODEL_TYPE["qwen3_moe" if p.qk_layernorm else "mixtral"]
    if p.qk_layernorm:
        return BY_MODEL_TYPE["qwen3"]
    if p.add_qkv_bias:
        return BY_MODEL_TYPE["qwen2"]
    if p.window_size is not None or isinstance(p, MistralModelProvider):
        return BY_MODEL_TYPE["mistral"]
    return BY_MODEL_TYPE["llama"]


def hf_config_from_provider(provider: Any, dtype: str) -> dict:
    """A config.json for `provider` (finalized) with weights in `dtype` ('bfloat16', ...)."""
    problems = Problems()
    family = family_of_provider(provider, problems)
    problems.raise_if_any()
    p = provider
    heads = p.num_attention_heads
    cfg: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.ffn_hidden_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": p.num_query_groups or heads,
        "head_dim": p.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": p.seq_length,
        "rms_norm_eps": p.layernorm_epsilon,
        "rope_theta": float(p.rotary_base),
        "tie_word_embeddings": p.share_embeddings_and_output_weights,
        "attention_dropout": p.attention_dropout,
        "initializer_range": p.init_method_std,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if p.rope_scaling:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": p.rope_scaling_factor, **LLAMA3_ROPE}
    elif p.seq_len_interpolation_factor:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": p.seq_len_interpolation_factor}
    if family.model_type in ("llama", "qwen3", "qwen3_moe"):
        cfg["attention_bias"] = False
    if family.model_type in ("mistral", "mixtral"):
        cfg["sliding_window"] = p.window_size[0] + 1 if p.window_size is not None else None
    if family.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        cfg["use_sliding_window"] = False
    if family.model_type == "mixtral":
        cfg.update(
            num_local_experts=p.num_moe_experts,
            num_experts_per_tok=p.moe_router_topk,
            intermediate_size=p.moe_ffn_hidden_size,
            router_aux_loss_coef=_scalar(p.moe_aux_loss_coeff),
            router_jitter_noise=p.moe_input_jitter_eps or 0.0,
        )
    if family.model_type == "qwen3_moe":
        cfg.update(
            num_experts=p.num_moe_experts,
            num_experts_per_tok=p.moe_router_topk,
            moe_intermediate_size=p.moe_ffn_hidden_size,
            norm_topk_prob=not p.moe_router_pre_softmax,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=_scalar(p.moe_aux_loss_coeff),
        )
    return cfg


def _scalar(value: Any) -> float:
    return float(value[0] if isinstance(value, (list, tuple)) else value)


ARCHITECTURE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "vocab_size", "normalization", "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
    "position_embedding_type", "share_embeddings_and_output_weights", "num_moe_experts", "moe_ffn_hidden_size",
)  # fmt: skip
"""Provider fields that decide which weights exist and their shapes."""


def architecture_differences(model: Any, reference: Any) -> list[tuple[str, Any, Any]]:
    """(field, model value, reference value) for each architecture field that differs. Sizes
    left to derive (None) count as what megatron-core derives; `model.vocab_size` left unset
    counts as the reference's."""
    out = []
    for name in ARCHITECTURE_FIELDS:
        mine, theirs = _effective(model, name), _effective(reference, name)
        if mine is None or mine == theirs:
            continue
        out.append((name, mine, theirs))
    return out


def _effective(p: Any, name: str) -> Any:
    value = getattr(p, name)
    if value is not None or not p.hidden_size or not p.num_attention_heads:
        return value
    if name == "num_query_groups":
        return p.num_attention_heads
    if name == "kv_channels":
        return p.hidden_size // p.num_attention_heads
    if name == "ffn_hidden_size":
        return 4 * p.hidden_size
    return None
