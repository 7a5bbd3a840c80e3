"""The helper process that runs the experiment trackers (started by `process.TrackerProcess`).

    python -m megatron_bridge.training.loggers.worker READ_FD WRITE_FD

Protocol (pickled tuples): in: ("specs", [TrackerSpec]) first, then ("metrics", Record),
("config", dict), ("close", failed); out: ("ready",) or ("error", type name, message) once
the trackers are built, ("closed", [errors]) at the end. The parent's end of the pipe closing
counts as a close of a failed run.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from megatron_bridge.training.loggers.base import Record, Tracker
from megatron_bridge.training.loggers.factory import TrackerSpec, instantiate

FLUSH_SECONDS = 1.0
"""Metrics are handed to the backends about this often: MLflow then writes a second's worth of
log steps in one `log_batch`, and this process wakes once a second, not at every log step."""

MAX_BATCH = 500
"""Log steps handed to the backends at once, at most; while more are waiting, the next batch
follows without the sleep."""

LAG_WARNING_SECONDS = 60.0
"""A warning (once) when the log steps being handed over are older than this."""


class _Hosted:
    """The trackers of this process; one that raises is reported once and then left out."""

    def __init__(self, trackers: list[tuple[str, Tracker]]):
        self.trackers = trackers
        self.errors: dict[str, str] = {}

    def each(self, action: str, method: str, argument: Any) -> None:
        """`tracker.<method>(argument)` on every tracker still working."""
        for name, tracker in self.trackers:
            if name in self.errors:
                continue
            try:
                getattr(tracker, method)(argument)
            except Exception as exc:  # noqa: BLE001 - one broken backend must not stop the others
                self.errors[name] = f"{name} {action} failed: {type(exc).__name__}: {exc}"
                print(
                    f"megatron_bridge: experiment tracker {self.errors[name]} (it records nothing more)",
                    file=sys.stderr,
                )

    def close(self, failed: bool) -> list[str]:
        errors = list(self.errors.values())
        for name, tracker in self.trackers:
            try:
                tracker.close(failed=failed)
            except Exception as exc:  # noqa: BLE001 - close every backend
                errors.append(f"{name} close failed: {type(exc).__name__}: {exc}")
        if "wandb" in sys.modules:  # this process owns W&B's service: make it write everything out
            sys.modules["wandb"].teardown()
        return errors


class StartFailed(Exception):
    """A tracker could not be built (`name`, the original `error`)."""

    def __init__(self, name: str, error: Exception):
        super().__init__(f"could not start the {name} tracker: {error}")
        self.name, self.error = name, error


def start(specs: list[TrackerSpec]) -> list[tuple[str, Tracker]]:
    """Build every tracker; if one fails, finish those already started as failed and raise."""
    built: list[tuple[str, Tracker]] = []
    for spec in specs:
        try:
            built.append((spec.name, instantiate(spec)))
        except Exception as exc:
            _Hosted(built).close(failed=True)
            raise StartFailed(spec.name, exc) from exc
    return built


def serve(inbox: Connection, outbox: Connection, hosted: _Hosted) -> None:
    behind = False
    warned = False
    while True:
        try:
            batch = [inbox.recv()]
            if batch[0][0] == "metrics":
                if not behind:
                    # Sleep rather than wait on the pipe: a reader waiting on it is woken by every
                    # log step, and each wake-up costs both processes a context switch.
                    time.sleep(FLUSH_SECONDS)
                while len(batch) < MAX_BATCH and batch[-1][0] == "metrics" and inbox.poll(0):
                    batch.append(inbox.recv())
                # What does not fit stays in the pipe: when it is full, training waits for this
                # process instead of this process holding an ever longer backlog in memory.
                behind = len(batch) == MAX_BATCH
        except EOFError:  # the training process went away without closing
            hosted.close(failed=True)
            return
        if batch[0][0] == "metrics" and not warned:
            lag = time.time() - batch[0][1].wall_time
            if lag > LAG_WARNING_SECONDS:
                warned = True
                print(
                    f"megatron_bridge: the experiment trackers are {lag:.0f} s behind training: their "
                    "process gets only the CPU time training leaves idle, and their backends need more "
                    "than that per log step. Training waits for them once the pipe to them is full; "
                    "log less often (logger.log_interval), or on CPU leave a core free (OMP_NUM_THREADS).",
                    file=sys.stderr,
                )
        records: list[Record] = []
        for kind, payload in batch:
            if kind == "metrics":
                records.append(payload)
                continue
            if records:
                hosted.each("logging", "log_many", records)
                records = []
            if kind == "config":
                hosted.each("logging the config", "log_config", payload)
            elif kind == "close":
                _reply(outbox, ("closed", hosted.close(failed=payload)))
                return
        if records:
            hosted.each("logging", "log_many", records)


def background() -> None:
    """Run this process (and the threads and processes it starts) only on CPU time that training
    leaves idle: on a machine whose cores training keeps busy (CPU training with one intra-op
    thread per core), tracker work at normal priority stalls training's parallel regions."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:
            pass
    os.nice(19)


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group: the training process handles it and then closes
    # this one (marking runs failed), so this process must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    background()
    inbox = Connection(int(argv[1]), writable=False)
    outbox = Connection(int(argv[2]), readable=False)
    try:
        _, specs = inbox.recv()
    except EOFError:
        return 0
    try:
        hosted = _Hosted(start(specs))
    except StartFailed as exc:  # reported to the training process, which raises it
        if type(exc.error).__module__ != "builtins":  # a backend's own error: its traceback helps
            traceback.print_exception(exc.error)
        _reply(outbox, ("error", type(exc.error).__name__, str(exc)))
        return 1
    if not _reply(outbox, ("ready",)):
        hosted.close(failed=True)
        return 0
    serve(inbox, outbox, hosted)
    return 0


def _reply(outbox: Connection, message: tuple) -> bool:
    """Send `message` to the training process; False if it is gone (killed or stopped by a signal
    while this process started): then there is no one to tell, and nothing to report."""
    try:
        outbox.send(message)
    except OSError:  # BrokenPipeError: the training process's end of the pipe is closed
        return False
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv))
