"""TensorBoard event files."""

from __future__ import annotations

from typing import Any, Mapping

from megatron_bridge.extras import require
from megatron_bridge.training.loggers.base import Tracker


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, log_dir: str, queue_size: int = 1000):
        require("tensorboard", "logger.tensorboard_dir")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        import yaml

        self.writer.add_text("config", "```\n" + yaml.safe_dump(_plain(config), sort_keys=False) + "\n```", 0)

    def close(self, failed: bool = False) -> None:
        self.writer.flush()
        self.writer.close()


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
