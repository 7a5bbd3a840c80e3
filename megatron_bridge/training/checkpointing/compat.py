"""Refuse to load a checkpoint whose model architecture differs from the config's, when its
weights are loaded (`check_architecture`); validation checked the same fields before anything
was built (`megatron_bridge.training.config.architecture`)."""

from __future__ import annotations

from typing import Any

from megatron_bridge.config.serialization import ConfigEncoder
from megatron_bridge.runtime.checkpointing.run_config import read_run_config
from megatron_bridge.models.saved_architecture import ARCHITECTURE_FIELDS


class CheckpointMismatchError(ValueError):
    """The checkpoint was trained with a different model architecture."""


def architecture_differences(checkpoint_dir: str, model: Any) -> list[str]:
    """`model.<field>: checkpoint X, config Y` for each architecture field that differs; empty if
    the checkpoint has no run_config.yaml."""
    run_config = read_run_config(checkpoint_dir)
    if run_config is None:
        return []
    saved = run_config.section("model")
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
