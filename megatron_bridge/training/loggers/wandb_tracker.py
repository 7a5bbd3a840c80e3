"""Weights & Biases: one `run.log` per log step. Offline runs follow W&B's own WANDB_MODE=offline."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from megatron_bridge.extras import require
from megatron_bridge.training.loggers.base import Tracker, plain


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(
        self, project: str, name: Optional[str] = None, entity: Optional[str] = None, save_dir: Optional[str] = None
    ):
        wandb = require("wandb", "logger.wandb_project")
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        try:
            # A run of its own: neither returns nor finishes a run the calling program has active.
            self.run = wandb.init(project=project, name=name, entity=entity, dir=save_dir, reinit="create_new")
        except wandb.errors.UsageError as exc:  # no API key, say
            raise ValueError(
                f"logger.wandb_project={project!r}: W&B refused to start: {exc} "
                "(set WANDB_API_KEY or run `wandb login`, or set WANDB_MODE=offline to log offline)"
            ) from None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(plain(config), allow_val_change=True)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
