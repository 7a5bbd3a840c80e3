"""Refuse to load a checkpoint whose model architecture differs from the config's."""

from __future__ import annotations

import os
from typing import Any

from megatron_bridge.training.checkpointing.layout import RUN_CONFIG_FILE

ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "normalization",
    "gated_linear_unit",
    "activation_func",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "position_embedding_type",
    "vocab_size",
    "share_embeddings_and_output_weights",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
)
"""Model fields that decide the shapes and meaning of the weights."""


class CheckpointMismatchError(ValueError):
    """The checkpoint was trained with a different model architecture."""


def architecture_differences(checkpoint_dir: str, model: Any) -> list[str]:
    """`model.<field>: checkpoint X, config Y` for each architecture field that differs; empty if
    the checkpoint has no run_config.yaml."""
    from megatron_bridge.config.serialization import ConfigEncoder

    path = os.path.join(checkpoint_dir, RUN_CONFIG_FILE)
    if not os.path.isfile(path):
        return []
    from megatron_bridge.config.secrets import restore_environment
    from megatron_bridge.config.yaml_input import load_file

    saved = restore_environment((load_file(path) or {}).get("model", {}))
    current = ConfigEncoder().value(model)  # the values themselves: both sides as this process sees them
    differences = []
    for name in ARCHITECTURE_FIELDS:
        if name in saved and name in current and saved[name] != current[name]:
            differences.append(f"model.{name}: checkpoint {saved[name]!r}, config {current[name]!r}")
    return differences


def check_architecture(checkpoint_dir: str, model: Any) -> None:
    differences = architecture_differences(checkpoint_dir, model)
    if differences:
        raise CheckpointMismatchError(
            f"the checkpoint at {checkpoint_dir!r} has a different model architecture:\n  - "
            + "\n  - ".join(differences)
            + "\n(load a checkpoint of this architecture, or change the model config to match it)"
        )
