"""The tracker interface, a null tracker for non-logging ranks, and fan-out to several."""

from __future__ import annotations

import time
from typing import Any, Iterator, Mapping, NamedTuple, Sequence


class Record(NamedTuple):
    """The metrics of one log step, as handed to a tracker."""

    step: int
    metrics: Mapping[str, float]
    wall_time: float


class Tracker:
    """An experiment tracker. Metrics arrive once per log step as one mapping (backends that
    support batching send them in one call)."""

    name = "tracker"

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalar `metrics` at iteration `step`."""

    def log_many(self, records: Sequence[Record]) -> None:
        """Record several log steps at once (backends with multi-step batches override this)."""
        for record in records:
            self.log_metrics(record.metrics, record.step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the resolved run configuration (nested mapping)."""

    def close(self, failed: bool = False) -> None:
        """Flush and finish; `failed` marks the run as failed where the backend supports it."""


class NullTracker(Tracker):
    """Stands in on ranks that do not log and when no tracker is configured."""

    name = "null"


class MultiTracker(Tracker):
    """Sends everything to each of several trackers."""

    name = "multi"

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step)

    def log_many(self, records: Sequence[Record]) -> None:
        for tracker in self.trackers:
            tracker.log_many(records)

    def log_config(self, config: Mapping[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_config(config)

    def close(self, failed: bool = False) -> None:
        errors = []
        for tracker in self.trackers:
            try:
                tracker.close(failed=failed)
            except Exception as exc:  # noqa: BLE001 - close the others before reporting
                errors.append(f"{tracker.name}: {exc}")
        if errors:
            raise RuntimeError("closing trackers failed: " + "; ".join(errors))


def now_record(metrics: Mapping[str, float], step: int) -> Record:
    return Record(step, metrics, time.time())


def plain(value: Any) -> Any:
    """`value` with mappings, sequences and scalars kept and anything else turned into a string
    (what every backend can store and what pickles across processes)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def flatten(config: Mapping[str, Any], sep: str = ".", prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf value) pairs of a nested mapping; lists stay whole leaves."""
    for key, value in config.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            yield from flatten(value, sep, name)
        else:
            yield name, value
