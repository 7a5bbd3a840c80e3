"""Checkpoints: saved so that no crash can corrupt the latest, resumed exactly, resharded on load.

The on-disk layout (`megatron_bridge.runtime.checkpointing.layout`) imports nothing heavy; the
manager and the architecture check load megatron-core, on first use of their names."""

from __future__ import annotations

import importlib
from typing import Any

from megatron_bridge.runtime.checkpointing.layout import TRACKER_FILE, has_checkpoint, read_tracker, resolve

_LAZY = {
    "CheckpointMismatchError": "compat",
    "CheckpointManager": "manager",
    "Checkpointer": "manager",
    "DefaultCheckpointManager": "manager",
    "make_manager": "manager",
}

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
