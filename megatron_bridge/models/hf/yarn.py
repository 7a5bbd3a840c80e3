"""YaRN rotary scaling in config.json <-> the provider's `yarn_*` fields.

transformers computes YaRN (`_compute_yarn_parameters`) as megatron-core's `YarnRotaryEmbedding`
does: the same inverse frequencies (interpolated by `factor` below the `beta_slow` rotation
count, kept above `beta_fast`, a linear ramp between, the bounds rounded outward when `truncate`)
and the same attention factor on cos and sin (0.1 ln(factor) + 1, or the ratio of two such terms
with `mscale` and `mscale_all_dim`). What megatron-core cannot express is refused by field: an
explicit `attention_factor` other than the computed one, YaRN over part of each head.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from megatron_bridge.config.errors import show
from megatron_bridge.models.gpt_provider import GPTModelProvider

if TYPE_CHECKING:
    from megatron_bridge.models.hf.config import ConfigReader


def no_yarn() -> dict[str, Any]:
    """The provider's `yarn_*` fields for plain rotary embeddings (`GPTModelProvider`'s
    defaults), for a provider class whose own defaults are YaRN's."""
    return {f.name: f.default for f in dataclasses.fields(GPTModelProvider) if f.name.startswith("yarn_")}


def attention_factor(factor: float, mscale: Any = None, mscale_all_dim: Any = None) -> float:
    """The factor on cos and sin, as transformers computes it without an explicit one."""

    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get(factor, mscale) / get(factor, mscale_all_dim))
    return get(factor)


def read_yarn(read: "ConfigReader", scaling: dict, field: str) -> dict[str, Any]:
    """Provider fields for the YaRN settings `scaling` (config.json's `field`: rope_scaling or
    rope_parameters); refusals go through `read`."""
    hf = read.hf

    def number(key: str, default: Any) -> Any:
        value = scaling.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            read.refuse(f"{field}.{key}", f"{show(value)} is not a number", "fix config.json")
            return default
        return value

    # transformers: a top-level original_max_position_embeddings wins over the one in the rope settings
    original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    read.used("original_max_position_embeddings")
    original = original or hf.get("max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        read.refuse(f"{field}.original_max_position_embeddings", f"{show(original)} is not a positive integer", "fix config.json")
        return {}
    factor = number("factor", None)
    if factor is None:  # transformers derives it from the two context lengths
        factor = hf.get("max_position_embeddings", original) / original
    mscale, mscale_all_dim = number("mscale", None), number("mscale_all_dim", None)
    out: dict[str, Any] = dict(
        position_embedding_type="yarn",
        yarn_rotary_scaling_factor=float(factor),
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=float(number("beta_fast", None) or 32.0),  # transformers: a missing or 0 beta is the default
        yarn_beta_slow=float(number("beta_slow", None) or 1.0),
        yarn_correction_range_round_to_int=bool(scaling.get("truncate", True)),
    )
    if mscale and mscale_all_dim:
        out.update(yarn_mscale=float(mscale), yarn_mscale_all_dim=float(mscale_all_dim))
    if factor < 1:
        read.refuse(f"{field}.factor", f"{show(factor)} is below 1 (YaRN extends the context)", "")
    given = number("attention_factor", None)
    computed = attention_factor(factor, mscale, mscale_all_dim)
    if given is not None and float(given) != computed:
        read.refuse(f"{field}.attention_factor", f"{show(given)}: megatron-core scales cos and sin by the factor "
                    f"YaRN computes from factor, mscale and mscale_all_dim ({computed!r})", "")  # fmt: skip
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        read.refuse("partial_rotary_factor", f"{show(partial)}: megatron-core's YaRN rotates whole heads", "")
    return out


def megatron_attention_factor(p: Any) -> float:
    """The factor megatron-core puts on cos and sin for provider `p` (its rule: the ratio once
    both yarn_mscale and yarn_mscale_all_dim are set, even to 0)."""

    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = p.yarn_rotary_scaling_factor
    if p.yarn_mscale is None or p.yarn_mscale_all_dim is None:
        return get(factor)
    return float(get(factor, p.yarn_mscale) / get(factor, p.yarn_mscale_all_dim))


def yarn_settings(p: Any) -> dict[str, Any]:
    """config.json rope settings (transformers 4's `rope_scaling` keys) for provider `p`'s YaRN;
    `attention_factor` is written where transformers would compute another one."""
    out: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": p.yarn_rotary_scaling_factor,
        "original_max_position_embeddings": p.yarn_original_max_position_embeddings,
        "beta_fast": p.yarn_beta_fast,
        "beta_slow": p.yarn_beta_slow,
        "truncate": p.yarn_correction_range_round_to_int,
    }
    if p.yarn_mscale and p.yarn_mscale_all_dim:
        out.update(mscale=p.yarn_mscale, mscale_all_dim=p.yarn_mscale_all_dim)
    ours = megatron_attention_factor(p)
    if ours != attention_factor(p.yarn_rotary_scaling_factor, out.get("mscale"), out.get("mscale_all_dim")):
        out["attention_factor"] = ours
    return out
