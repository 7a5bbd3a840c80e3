"""Save-and-exit on a signal (SIGTERM by default), at the next iteration boundary."""

from __future__ import annotations

import signal
import threading
from typing import Any


class ExitSignalHandler:
    """Records that `sig` arrived; the train loop checks `received()` each iteration (all ranks
    agree through an all-reduce), saves a checkpoint and exits cleanly."""

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = signal.Signals(sig)
        self._received = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> "ExitSignalHandler":
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            self._previous = signal.signal(self.sig, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self._received = True

    def received(self) -> bool:
        return self._received

    def restore(self) -> None:
        if self._installed:
            signal.signal(self.sig, self._previous)
            self._installed = False
