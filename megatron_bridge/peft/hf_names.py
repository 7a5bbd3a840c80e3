"""megatron-core module names and row layouts -> Hugging Face ones (Llama-style decoders).

Megatron-core fuses projections that Hugging Face models keep apart:

* `linear_qkv` holds, per query group, the group's query heads, then its key head, then its
  value head: rows [q_0 .. q_{h/g-1}, k, v] x g groups, each `kv_channels` rows. HF has
  `q_proj`, `k_proj`, `v_proj`.
* a gated `linear_fc1` holds all gate rows, then all up rows (as checkpoints store it). HF has
  `gate_proj` and `up_proj`.
* `linear_proj` is `o_proj`, `linear_fc2` is `down_proj`.

An adapter on a fused projection becomes one adapter per HF projection with the same A (its
input is the same) and B's rows split like the weight's; so does a DoRA magnitude (one value per
row). Llama, Mistral and Qwen2/Qwen3 (dense) use these names.
"""

from __future__ import annotations

import re
from typing import Any

import torch

LAYER_MODULES = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
"""Per transformer layer: megatron-core module -> the Hugging Face modules it holds, in row order."""

_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class UnmappedModuleError(ValueError):
    """A megatron-core module with no Hugging Face counterpart here (e.g. MoE experts)."""


def hf_modules(name: str) -> tuple[str, ...]:
    """The HF module names (`model.layers.3.self_attn.q_proj`, ...) of megatron-core module `name`
    (`decoder.layers.3.self_attention.linear_qkv`)."""
    m = _NAME.match(name)
    if not m or m.group(2) not in LAYER_MODULES:
        raise UnmappedModuleError(
            f"{name}: no Hugging Face counterpart is known (mapped: decoder.layers.N.{{{', '.join(LAYER_MODULES)}}})"
        )
    return tuple(f"model.layers.{m.group(1)}.{hf}" for hf in LAYER_MODULES[m.group(2)])


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


def split_rows(name: str, t: torch.Tensor, model_cfg: Any) -> tuple[torch.Tensor, ...]:
    """The rows of `t` (output rows of module `name`) for each HF module of `hf_modules(name)`."""
    leaf = _NAME.match(name).group(2)
    if leaf == "self_attention.linear_qkv":
        heads = model_cfg.num_attention_heads
        groups = model_cfg.num_query_groups or heads
        head_dim = model_cfg.kv_channels or model_cfg.hidden_size // heads
        return split_qkv_rows(t, heads, groups, head_dim)
    if leaf == "mlp.linear_fc1":
        if not model_cfg.gated_linear_unit:
            raise UnmappedModuleError(f"{name}: an ungated MLP has no Llama-style Hugging Face counterpart")
        return split_gate_up_rows(t)
    return (t,)
