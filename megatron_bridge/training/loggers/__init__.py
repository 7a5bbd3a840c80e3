"""Experiment trackers: one interface (`Tracker`), one object per backend, a null stand-in."""

from megatron_bridge.training.loggers.base import MultiTracker, NullTracker, Tracker
from megatron_bridge.training.loggers.factory import build_tracker

__all__ = ["MultiTracker", "NullTracker", "Tracker", "build_tracker"]
