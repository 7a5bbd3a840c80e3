"""megatron-core module names and row layouts -> Hugging Face ones.

Megatron-core fuses projections that Hugging Face models keep apart:

* `linear_qkv` holds, per query group, the group's query heads, then its key head, then its
  value head: rows [q_0 .. q_{h/g-1}, k, v] x g groups, each `kv_channels` rows. HF has
  `q_proj`, `k_proj`, `v_proj`.
* a gated `linear_fc1` holds all gate rows, then all up rows (as checkpoints store it). HF has
  `gate_proj` and `up_proj`.
* `linear_proj` is `o_proj`, `linear_fc2` is `down_proj`.

An adapter on a fused projection becomes one adapter per HF projection with the same A (its
input is the same) and B's rows split like the weight's; so does a DoRA magnitude (one value per
row). Llama, Mistral and Qwen2/Qwen3 (dense) use these names; a family whose Hugging Face files
fuse projections too (Phi-3: `qkv_proj`, `gate_up_proj`) names its modules in
`HFFamily.adapter_modules`, and the rows are reordered to its layout. Multi-latent attention's
projections (DeepSeek-V3) map one to one (`linear_q_down_proj` is `q_a_proj`, ...); where the
family stores a weight's rows in another order (`Rule.reorders_rows`), `hf_row_order` puts the
adapter's rows in that order.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from megatron_bridge.models.hf.family import HFFamily
from megatron_bridge.models.hf.registry import family_of_provider
from megatron_bridge.models.hf import mapping

LAYER_MODULES = HFFamily.adapter_modules
"""Per transformer layer: megatron-core module -> the Hugging Face modules it holds, in row order
(models without a Hugging Face family of their own use these)."""

_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class UnmappedModuleError(ValueError):
    """A megatron-core module with no Hugging Face counterpart here (e.g. MoE experts)."""


def layer_modules(model_cfg: Any = None) -> dict[str, tuple[str, ...]]:
    """The module names of the Hugging Face family of `model_cfg` (default: Llama-style)."""
    if model_cfg is None:
        return LAYER_MODULES

    family = family_of_provider(model_cfg)
    return family.adapter_modules if family is not None else LAYER_MODULES


def hf_modules(name: str, model_cfg: Any = None) -> tuple[str, ...]:
    """The HF module names (`model.layers.3.self_attn.q_proj`, ...) of megatron-core module `name`
    (`decoder.layers.3.self_attention.linear_qkv`) in the Hugging Face family of `model_cfg`."""
    modules = layer_modules(model_cfg)
    m = _NAME.match(name)
    if not m or m.group(2) not in modules:
        raise UnmappedModuleError(
            f"{name}: no Hugging Face counterpart is known (mapped: decoder.layers.N.{{{', '.join(modules)}}})"
        )
    return tuple(f"model.layers.{m.group(1)}.{hf}" for hf in modules[m.group(2)])


def split_qkv_rows(t: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """(q, k, v) rows of a tensor laid out like megatron-core's `linear_qkv` output."""
    per_group = num_heads // num_groups
    grouped = t.reshape(num_groups, (per_group + 2) * head_dim, *t.shape[1:])
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return tuple(x.reshape(-1, *t.shape[1:]).contiguous() for x in (q, k, v))


def split_gate_up_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) rows of a gated first MLP projection (as stored in checkpoints)."""
    gate, up = t.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def hf_row_order(name: str, t: torch.Tensor, hf_config: Optional[dict]) -> torch.Tensor:
    """`t` (output rows of module `name`, as the model holds them) in the row order of the
    Hugging Face weight of `hf_config`, for a family that stores some weights' rows in another
    order than megatron-core (`Rule.reorders_rows`: DeepSeek-V3's rotary rows in halves)."""
    if hf_config is None:
        return t

    rule = mapping.rule_for(mapping.architecture(hf_config), f"{name}.weight")
    if rule is None or not rule.reorders_rows:
        return t
    (reordered,) = rule.to_hf([t], mapping.Partition()).values()
    return reordered


def split_rows(name: str, t: torch.Tensor, model_cfg: Any) -> tuple[torch.Tensor, ...]:
    """The rows of `t` (output rows of module `name`) for each HF module of `hf_modules(name)`."""
    leaf = _NAME.match(name).group(2)
    fused = len(layer_modules(model_cfg)[leaf]) == 1
    if leaf == "self_attention.linear_qkv":
        heads = model_cfg.num_attention_heads
        groups = model_cfg.num_query_groups or heads
        head_dim = model_cfg.kv_channels or model_cfg.hidden_size // heads
        q, k, v = split_qkv_rows(t, heads, groups, head_dim)
        return (torch.cat([q, k, v]),) if fused else (q, k, v)
    if leaf.endswith("linear_fc1"):  # a dense MLP's or the shared experts'
        if not model_cfg.gated_linear_unit:
            raise UnmappedModuleError(f"{name}: an ungated MLP has no Llama-style Hugging Face counterpart")
        return (t,) if fused else split_gate_up_rows(t)  # stored [all gate rows; all up rows]
    return (t,)
