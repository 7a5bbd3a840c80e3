"""MLflow: metrics in `log_batch` calls, the config as flattened params, FAILED runs marked so.

Uses an `MlflowClient` (not the fluent API) so that it neither needs nor touches an active run of
the calling program.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator, Mapping, Optional, Sequence

from megatron_bridge.extras import require
from megatron_bridge.training.loggers.base import Record, Tracker, flatten, now_record

# MLflow's limits (mlflow.utils.validation); kept here so that a change there fails loudly in tests
# rather than silently here.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE_LENGTH = 6000
MAX_KEY_LENGTH = 250
_BAD_KEY_CHARS = re.compile(r"[^\w\-. /:]")


class MlflowTracker(Tracker):
    """One MLflow run in `experiment` (created if missing).

    `checkpoint_dir`: when given, its content is copied to the run's artifacts under `checkpoints/`
    when the run closes (`logger.mlflow_log_checkpoints`).
    """

    name = "mlflow"

    def __init__(
        self,
        experiment: str,
        run_name: str,
        tracking_uri: Optional[str] = None,
        tags: Optional[Mapping[str, str]] = None,
        checkpoint_dir: Optional[str] = None,
    ):
        require("mlflow", "logger.mlflow_experiment")
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        experiment_id = _experiment_id(self.client, experiment)
        tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        self.checkpoint_dir = checkpoint_dir

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.log_many([now_record(metrics, step)])

    def log_many(self, records: Sequence[Record]) -> None:
        from mlflow.entities import Metric

        rows = [
            Metric(key, float(value), int(wall_time * 1000), step)
            for step, metrics, wall_time in records
            for key, value in metrics.items()
        ]
        for chunk in _chunks(rows, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, value) for key, value in config_params(config)]
        for chunk in _chunks(params, MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk, synchronous=True)

    def close(self, failed: bool = False) -> None:
        try:
            if self.checkpoint_dir and os.path.isdir(self.checkpoint_dir):
                self._log_checkpoints()
        finally:
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

    def _log_checkpoints(self) -> None:
        """The checkpoints and their tracker file, without hidden files (the running job's lock on
        the directory is still there while trackers close)."""
        for name in sorted(os.listdir(self.checkpoint_dir)):
            if name.startswith("."):
                continue
            path = os.path.join(self.checkpoint_dir, name)
            if os.path.isdir(path):
                self.client.log_artifacts(self.run_id, path, artifact_path=f"checkpoints/{name}")
            else:
                self.client.log_artifact(self.run_id, path, artifact_path="checkpoints")


def _experiment_id(client: Any, name: str) -> str:
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # another job created it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def config_params(config: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """The config as MLflow params: dotted keys, string values cut to MLflow's length limit."""
    for dotted, value in flatten(config):
        key = _BAD_KEY_CHARS.sub("_", dotted)[:MAX_KEY_LENGTH]
        text = "None" if value is None else str(value)
        if len(text) > MAX_PARAM_VALUE_LENGTH:
            marker = "...[truncated]"
            text = text[: MAX_PARAM_VALUE_LENGTH - len(marker)] + marker
        yield key, text


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
