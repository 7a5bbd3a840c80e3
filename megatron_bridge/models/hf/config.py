"""Hugging Face `config.json` <-> model providers.

`provider_from_hf` reads a config.json and returns the provider of its family (see
`registry`) with every architecture field set from it. A setting the provider cannot reproduce
(an architecture we do not convert, a rope type we do not implement, per-layer sliding windows,
biases we do not have, quantized weights) is a `ConfigValidationError` naming the field:
converting such a model would silently change what it computes. `hf_config_from_provider`
writes the inverse.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError, Problems, show
from megatron_bridge.models.hf import registry
from megatron_bridge.models.hf.files import config_path, read_json

logger = logging.getLogger(__name__)

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
    return ConfigProblem(path, message, fix)


def family_of(hf: dict, problems: Problems, where: str = "config.json") -> Optional[Any]:
    """The family of a config.json, or None (with a problem naming the `architectures` field)."""
    return registry.family_of(hf, problems, where)


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
    family = registry.family_of(hf, problems, where)
    if family is None:
        return None
    start = len(problems)
    read = ConfigReader(hf, problems, where)
    fields = family.provider_fields(read)
    read.report_unused()
    if len(problems) > start:
        return None
    return family.build_provider(fields)


class ConfigReader:
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
def family_of_provider(provider: Any, problems: Problems) -> Optional[Any]:
    """The Hugging Face family that computes what `provider` computes, or None (with a problem
    naming each setting the nearest family cannot express)."""
    return registry.family_of_provider(provider, problems)


def hf_config_from_provider(provider: Any, dtype: str) -> dict:
    """A config.json for `provider` (finalized) with weights in `dtype` ('bfloat16', ...)."""
    problems = Problems()
    family = family_of_provider(provider, problems)
    problems.raise_if_any()
    return family.hf_config(provider, dtype)


WEIGHT_SHAPE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "vocab_size", "normalization", "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
    "position_embedding_type", "share_embeddings_and_output_weights", "num_moe_experts", "moe_ffn_hidden_size",
    "input_layernorms", "output_layernorms", "qk_layernorm_per_head", "multi_latent_attention", "q_lora_rank",
    "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
)  # fmt: skip
"""Provider fields that decide which weights exist and their shapes (the checkpoints of runs compare
them too, with the activation: `megatron_bridge.models.saved_architecture`)."""


def architecture_differences(model: Any, reference: Any) -> list[tuple[str, Any, Any]]:
    """(field, model value, reference value) for each architecture field that differs. Sizes
    left to derive (None) count as what megatron-core derives; `model.vocab_size` left unset
    counts as the reference's."""
    out = []
    for name in WEIGHT_SHAPE_FIELDS:
        mine, theirs = _effective(model, name), _effective(reference, name)
        if mine is None or mine == theirs:
            continue
        out.append((name, mine, theirs))
    return out


NOT_COMPUTATION_FIELDS = frozenset(
    {
        "seq_length", "attention_dropout", "hidden_dropout", "init_method_std", "make_vocab_size_divisible_by",
        "moe_aux_loss_coeff", "moe_input_jitter_eps", "moe_router_load_balancing_type",
    }
)  # fmt: skip
"""Fields `from_hf` sets that do not change what a trained model computes (training settings, or
checked on their own: `seq_length`)."""


def computation_differences(model: Any, reference: Any) -> list[tuple[str, Any, Any]]:
    """(field, model value, reference value) for each field `from_hf` set on `reference`, other
    than the architecture's shapes, that `model` has otherwise: rotary settings, windows, norms,
    caps, activation, routing. Weights loaded into such a model compute something else."""
    out = []
    for name in sorted(reference.explicit_fields() - set(WEIGHT_SHAPE_FIELDS) - NOT_COMPUTATION_FIELDS):
        if not hasattr(model, name):
            continue
        mine, theirs = getattr(model, name), getattr(reference, name)
        if callable(mine) and callable(theirs):
            mine, theirs = getattr(mine, "__name__", mine), getattr(theirs, "__name__", theirs)
        if mine != theirs:
            out.append((name, mine, theirs))
    return out


def _effective(p: Any, name: str) -> Any:
    value = getattr(p, name, None)  # MLA sizes: only multi-latent attention providers have them
    if value is not None or not p.hidden_size or not p.num_attention_heads:
        return value
    if name == "num_query_groups":
        return p.num_attention_heads
    if name == "kv_channels":
        return p.hidden_size // p.num_attention_heads
    if name == "ffn_hidden_size":
        return 4 * p.hidden_size
    return None
