"""Checkpoints: saved so that no crash can corrupt the latest, resumed exactly, resharded on load."""

from megatron_bridge.training.checkpointing.compat import CheckpointMismatchError
from megatron_bridge.training.checkpointing.layout import TRACKER_FILE, has_checkpoint, read_tracker, resolve
from megatron_bridge.training.checkpointing.manager import (
    CheckpointManager,
    Checkpointer,
    DefaultCheckpointManager,
    make_manager,
)

__all__ = [
    "CheckpointManager",
    "CheckpointMismatchError",
    "Checkpointer",
    "DefaultCheckpointManager",
    "TRACKER_FILE",
    "has_checkpoint",
    "make_manager",
    "read_tracker",
    "resolve",
]
