"""Comet: one `log_metrics` per log step; offline experiments (a zip per run) when a directory is set."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from megatron_bridge.extras import require
from megatron_bridge.training.loggers.base import Tracker, plain


class CometTracker(Tracker):
    """A Comet experiment. Online it needs an API key (`api_key`, COMET_API_KEY or Comet's config
    file); with `offline_directory` it writes there instead and needs none."""

    name = "comet"

    def __init__(
        self,
        project: str,
        experiment_name: str,
        workspace: Optional[str] = None,
        api_key: Optional[str] = None,
        tags: Optional[Sequence[str]] = None,
        offline_directory: Optional[str] = None,
    ):
        comet_ml = require("comet_ml", "logger.comet_project")
        online = offline_directory is None
        if online and not comet_ml.config.get_api_key(api_key, comet_ml.config.get_config()):
            raise ValueError(
                f"logger.comet_project={project!r}: Comet needs an API key to log online "
                "(set logger.comet_api_key or COMET_API_KEY, or logger.comet_offline_directory to log offline)"
            )
        settings = comet_ml.ExperimentConfig(
            name=experiment_name,
            tags=list(tags or []),
            offline_directory=offline_directory,
            # This tracker logs what the train loop measures; Comet's own patching of frameworks
            # would log the same scalars twice and costs time in the training process.
            auto_metric_logging=False,
            auto_param_logging=False,
            parse_args=False,
            log_code=False,
            log_graph=False,
            log_git_metadata=False,
            log_git_patch=False,
            display_summary_level=0,
        )
        self.experiment = comet_ml.start(
            api_key=api_key, workspace=workspace, project_name=project, online=online, experiment_config=settings
        )

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.experiment.log_metrics(dict(metrics), step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.experiment.log_parameters(plain(config))

    def close(self, failed: bool = False) -> None:
        # Comet has no failed state for an experiment; record the outcome where the UI shows it.
        self.experiment.log_other("status", "failed" if failed else "finished")
        self.experiment.end()
