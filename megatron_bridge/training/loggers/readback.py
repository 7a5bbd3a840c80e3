"""Read a finished (or running) run's metrics back: from TensorBoard event files or from MLflow."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Optional

from megatron_bridge.extras import require


@dataclass
class Series:
    """One metric over iterations."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class RunMetrics:
    """A run's metrics by name, and the label it is shown under."""

    label: str
    series: dict[str, Series] = field(default_factory=dict)


def _merged(points: Iterable[tuple[int, float]]) -> Series:
    # A resumed run logs some steps again: the later value of a step wins.
    by_step = {}
    for step, value in points:
        by_step[int(step)] = float(value)
    steps = sorted(by_step)
    return Series(steps, [by_step[s] for s in steps])


def event_dirs(run_dir: str) -> list[str]:
    """Directories under `run_dir` (itself included) that hold TensorBoard event files."""
    found = []
    for root, _, files in os.walk(run_dir):
        if any(name.startswith("events.out.tfevents") for name in files):
            found.append(root)
    return sorted(found)


def read_tensorboard(run_dir: str, label: Optional[str] = None) -> RunMetrics:
    """Every scalar in the event files under `run_dir` (searched recursively)."""
    require("tensorboard", "reading TensorBoard event files")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir}: no such directory")
    dirs = event_dirs(run_dir)
    if not dirs:
        raise ValueError(f"{run_dir}: no TensorBoard event files (events.out.tfevents.*) under it")
    points: dict[str, list[tuple[int, float]]] = {}
    for directory in dirs:
        events = EventAccumulator(directory, size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            points.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
    name = label or os.path.basename(os.path.normpath(run_dir))
    return RunMetrics(name, {tag: _merged(p) for tag, p in points.items()})


def read_mlflow(tracking_uri: str, run: str, experiment: Optional[str] = None) -> RunMetrics:
    """Every metric of the MLflow run named (or with the id) `run`, at `tracking_uri` (e.g.
    `sqlite:///mlflow.db`); `experiment` narrows the search when run names repeat."""
    require("mlflow", "reading MLflow runs")
    from mlflow import MlflowClient

    store = _local_store(tracking_uri)
    if store is not None and not os.path.exists(store):  # no run there; MLflow would create an empty store
        raise ValueError(f"no MLflow run named {run!r} at {tracking_uri}")
    client = MlflowClient(tracking_uri=tracking_uri)
    if experiment is not None:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise ValueError(f"no MLflow experiment named {experiment!r} at {tracking_uri}")
        experiments = [found]
    else:
        experiments = client.search_experiments()
    ids = [e.experiment_id for e in experiments]
    matches = client.search_runs(ids, filter_string=f"attributes.run_name = '{_quoted(run)}'") if ids else []
    if not matches:
        matches = [r for r in client.search_runs(ids) if r.info.run_id == run] if ids else []
    if not matches:
        raise ValueError(f"no MLflow run named {run!r} at {tracking_uri}")
    if len(matches) > 1:
        listed = ", ".join(m.info.run_id for m in matches)
        raise ValueError(
            f"{len(matches)} MLflow runs are named {run!r} at {tracking_uri} ({listed}): pass a run id instead"
        )
    run_id = matches[0].info.run_id
    series = {}
    for key in matches[0].data.metrics:
        series[key] = _merged((m.step, m.value) for m in client.get_metric_history(run_id, key))
    return RunMetrics(run, series)


def _local_store(tracking_uri: str) -> Optional[str]:
    """The file or directory of a local MLflow store (sqlite:///PATH, file://PATH, a path); None
    for a server."""
    for scheme in ("sqlite:///", "file://"):
        if tracking_uri.startswith(scheme):
            return tracking_uri[len(scheme) :] or None
    return None if "://" in tracking_uri else tracking_uri


def _quoted(text: str) -> str:
    return text.replace("'", "\\'")
