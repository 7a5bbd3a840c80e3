"""Create the trackers a `LoggerConfig` asks for, on the logging rank only."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

from megatron_bridge.config.secrets import conceal_argv
from megatron_bridge.training.loggers.base import MultiTracker, NullTracker, Tracker
from megatron_bridge.training.loggers.process import TrackerProcess

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer

logger = logging.getLogger("megatron_bridge")
_PACKAGE = "megatron_bridge.training.loggers"


class TrackerSpec(NamedTuple):
    """How to build one tracker: plain data, so it can be sent to the tracker process."""

    name: str
    module: str
    cls: str
    kwargs: dict[str, Any]


def instantiate(spec: TrackerSpec) -> Tracker:
    """Import the tracker's module (and so its backend) only now."""
    return getattr(importlib.import_module(spec.module), spec.cls)(**spec.kwargs)


def tracker_specs(cfg: "ConfigContainer") -> list[TrackerSpec]:
    """One spec per backend that `cfg.logger` configures."""
    log = cfg.logger
    specs = []
    if log.tensorboard_dir:
        specs.append(
            TrackerSpec(
                "tensorboard",
                f"{_PACKAGE}.tensorboard",
                "TensorBoardTracker",
                dict(
                    log_dir=log.tensorboard_dir,
                    queue_size=log.tensorboard_queue_size,
                    every=log.tensorboard_log_interval,
                ),
            )
        )
    if log.wandb_project:
        specs.append(
            TrackerSpec(
                "wandb",
                f"{_PACKAGE}.wandb_tracker",
                "WandbTracker",
                dict(
                    project=log.wandb_project,
                    name=log.wandb_exp_name,
                    entity=log.wandb_entity,
                    save_dir=log.wandb_save_dir,
                ),
            )
        )
    if log.mlflow_experiment:
        if log.mlflow_log_checkpoints and not cfg.checkpoint.save:
            logger.warning("logger.mlflow_log_checkpoints is on but checkpoint.save is not set: no checkpoints to log")
        specs.append(
            TrackerSpec(
                "mlflow",
                f"{_PACKAGE}.mlflow_tracker",
                "MlflowTracker",
                dict(
                    experiment=log.mlflow_experiment,
                    run_name=log.mlflow_run_name,
                    tracking_uri=log.mlflow_tracking_uri,
                    tags=dict(log.mlflow_tags or {}),
                    checkpoint_dir=cfg.checkpoint.save if log.mlflow_log_checkpoints else None,
                ),
            )
        )
    if log.comet_project:
        specs.append(
            TrackerSpec(
                "comet",
                f"{_PACKAGE}.comet_tracker",
                "CometTracker",
                dict(
                    project=log.comet_project,
                    experiment_name=log.comet_experiment_name,
                    workspace=log.comet_workspace,
                    api_key=log.comet_api_key,
                    tags=list(log.comet_tags or []),
                    offline_directory=log.comet_offline_directory,
                ),
            )
        )
    return specs


BACKEND_SETTINGS = {
    "tensorboard_dir": ("TensorBoard", ("tensorboard_log_interval", "tensorboard_queue_size")),
    "wandb_project": ("W&B", ("wandb_exp_name", "wandb_save_dir", "wandb_entity")),
    "mlflow_experiment": ("MLflow", ("mlflow_run_name", "mlflow_tracking_uri", "mlflow_tags", "mlflow_log_checkpoints")),
    "comet_project": ("Comet", ("comet_experiment_name", "comet_workspace", "comet_tags", "comet_offline_directory")),
}
"""The setting that turns each tracker on, and the settings that only that tracker reads."""


def unused_backend_settings(log: Any) -> list[str]:
    """What a `LoggerConfig` sets for a tracker that it does not turn on (a run name given, the
    project forgotten): one line per tracker, naming the setting that would turn it on."""
    defaults = {f.name: f.default for f in dataclasses.fields(log)}
    lines = []
    for switch, (what, names) in BACKEND_SETTINGS.items():
        if getattr(log, switch):
            continue
        changed = [n for n in names if getattr(log, n) != defaults[n]]
        if changed:
            shown = ", ".join(f"logger.{n}" for n in changed)
            lines.append(f"{shown} set, but logger.{switch} is not: no {what} logging (set logger.{switch} to turn it on)")
    return lines


def build_tracker(cfg: "ConfigContainer", is_logging_rank: bool) -> Tracker:
    """The configured trackers on the logging rank (in a helper process unless
    `logger.tracker_subprocess` is off); a `NullTracker` elsewhere and when none is configured."""
    if not is_logging_rank:
        return NullTracker()
    for line in unused_backend_settings(cfg.logger):
        logger.warning(line)
    specs = tracker_specs(cfg)
    if not specs:
        return NullTracker()
    if cfg.logger.tracker_subprocess:
        return TrackerProcess(specs)
    trackers: list[Tracker] = []
    argv = sys.argv
    try:
        sys.argv = conceal_argv(argv)  # backends record the command line (credentials given as overrides)
        for spec in specs:
            trackers.append(instantiate(spec))
    except Exception:
        with contextlib.suppress(Exception):  # the error that stopped the start matters more
            MultiTracker(trackers).close(failed=True)
        raise
    finally:
        sys.argv = argv
    return trackers[0] if len(trackers) == 1 else MultiTracker(trackers)
