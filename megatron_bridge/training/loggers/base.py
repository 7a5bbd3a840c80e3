"""The tracker interface, a null tracker for non-logging ranks, and fan-out to several."""

from __future__ import annotations

from typing import Any, Mapping


class Tracker:
    """An experiment tracker. Metrics arrive once per log step as one mapping (backends that
    support batching send them in one call)."""

    name = "tracker"

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalar `metrics` at iteration `step`."""

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
