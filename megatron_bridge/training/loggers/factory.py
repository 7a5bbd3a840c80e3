"""Create the trackers a `LoggerConfig` asks for, on the logging rank only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_bridge.training.loggers.base import MultiTracker, NullTracker, Tracker

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer


def build_tracker(cfg: "ConfigContainer", is_logging_rank: bool) -> Tracker:
    """The configured trackers (fanned out) on the logging rank; a `NullTracker` elsewhere."""
    if not is_logging_rank:
        return NullTracker()
    log = cfg.logger
    trackers: list[Tracker] = []
    if log.tensorboard_dir:
        from megatron_bridge.training.loggers.tensorboard import TensorBoardTracker

        trackers.append(TensorBoardTracker(log.tensorboard_dir, log.tensorboard_queue_size))
    if not trackers:
        return NullTracker()
    return trackers[0] if len(trackers) == 1 else MultiTracker(trackers)
