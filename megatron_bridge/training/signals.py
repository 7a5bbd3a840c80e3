"""Save-and-exit on a signal (SIGTERM by default, and Ctrl-C), at the next iteration boundary.

Evaluation stops at its next batch, and a signal that arrives before the first iteration stops
the run before it trains: a preemption's grace period is short, and a run must not spend it on
a long evaluation or on training one more step to have something to save.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Optional

import torch


class ExitSignalHandler:
    """Records that `sig` (or SIGINT, i.e. Ctrl-C) arrived; the train loop checks `received()`
    each iteration (all ranks agree through an all-reduce), saves a checkpoint and exits cleanly.
    A second SIGINT aborts at once, as an impatient Ctrl-C expects."""

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = signal.Signals(sig)
        self.signals = tuple(dict.fromkeys((self.sig, signal.SIGINT)))
        self._received = False
        self._interrupts = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> "ExitSignalHandler":
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                self.restore()
                raise KeyboardInterrupt("second Ctrl-C: aborting without saving")
        self._received = True

    def received(self) -> bool:
        return self._received

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


def exit_requested(handler: Optional[ExitSignalHandler], device: str) -> bool:
    """Whether any rank received the exit signal. A collective over all ranks when a handler is
    installed (every rank has one or none: it follows `train.exit_signal_handler`)."""
    if handler is None:
        return False
    vote = torch.tensor([int(handler.received())], dtype=torch.int32, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX)
    return bool(vote.item())
