"""Training processes stop when their launcher dies.

torchrun (and launchers built on it, such as ft_launcher) starts the training processes as its
children and waits for them. Killed with SIGKILL, it can no longer stop them: they were
re-parented and went on training, their helper processes with them. A training process started
by such a launcher therefore watches its parent and, once the parent is gone, sends itself
SIGTERM: it stops as on a preemption, saving a checkpoint first where `train.exit_signal_handler`
handles SIGTERM, and its helpers end with it.

The parent is polled from a daemon thread rather than tied with `PR_SET_PDEATHSIG`: that signal
fires when the *thread* that started the process exits, which a launcher may do while it lives.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

LAUNCHER_VARIABLE = "TORCHELASTIC_RUN_ID"
"""Set by torchrun (torch.distributed.elastic) in the environment of the processes it starts."""

POLL_SECONDS = 1.0
"""How often the parent is checked: a killed launcher's processes stop within about this long
(plus the iteration in progress)."""

_watcher: Optional[threading.Thread] = None


def started_by_launcher() -> bool:
    return LAUNCHER_VARIABLE in os.environ


def stop_when_launcher_dies(poll_seconds: float = POLL_SECONDS) -> bool:
    """Under torchrun, SIGTERM this process once its parent (the launcher) has died. Returns
    whether a watch is on. Idempotent; a no-op for a process not started by a launcher."""
    global _watcher
    if _watcher is not None and _watcher.is_alive():
        return True
    if not started_by_launcher():
        return False
    launcher = os.getppid()
    if launcher == 1:  # re-parented to init already: the launcher died while this process started
        _stop(launcher)
        return True
    _watcher = threading.Thread(target=_watch, args=(launcher, poll_seconds), name="launcher-watch", daemon=True)
    _watcher.start()
    return True


def _watch(launcher: int, poll_seconds: float) -> None:
    while os.getppid() == launcher:
        time.sleep(poll_seconds)
    _stop(launcher)


def _stop(launcher: int) -> None:
    import logging

    logging.getLogger("megatron_bridge").warning(
        "the launcher (process %d) is gone: stopping as on SIGTERM", launcher
    )
    os.kill(os.getpid(), signal.SIGTERM)
