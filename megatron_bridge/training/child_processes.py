"""Helper processes that die with the trainer.

megatron-core's checkpoint writer forks processes (a background saver, one writer per bucket)
and keeps a `multiprocessing` manager for their results. If the trainer is killed with SIGKILL,
nothing tells them to stop: they were re-parented to init and lived on, holding hundreds of MB
each. Here every process forked by the trainer asks Linux to SIGKILL it when its parent dies
(`PR_SET_PDEATHSIG`), and the results manager, a spawned process (forking a server from a
trainer whose libraries run threads can crash it), does the same when it starts.

Some helpers must outlive their parent on purpose: nvidia-resiliency-ext's restart monitor is
a daemon made by a double fork, whose middle process exits at once. They are started inside
`children_may_outlive_parent()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
from typing import Any, Callable, Optional

_PR_SET_PDEATHSIG = 1
_installed = False
_parent_pid = 0
_exempt = False
_results_manager: Any = None


def _load_prctl() -> Optional[Callable[..., int]]:
    # Looked up in the parent: loading libraries in a child forked from a threaded process can hang.
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def _die_when_parent_dies(parent_pid: int) -> None:
    if _prctl is None:
        return
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _before_fork() -> None:
    global _parent_pid
    _parent_pid = os.getpid()


def _in_child() -> None:
    if not _exempt:
        _die_when_parent_dies(_parent_pid)


def die_with_parent() -> None:
    """From now on, processes forked by this process are killed when it dies (Linux; elsewhere
    a no-op). Idempotent."""
    global _installed
    if _installed or _prctl is None:
        return
    os.register_at_fork(before=_before_fork, after_in_child=_in_child)
    _installed = True


def install_checkpoint_results_queue() -> None:
    """Give megatron-core's checkpoint writer a results queue whose manager process dies with
    this one (megatron-core's own outlived a killed trainer)."""
    global _results_manager
    die_with_parent()
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        _results_manager = SyncManager(ctx=mp.get_context("spawn"))
        _results_manager.start(initializer=_die_when_parent_dies, initargs=(os.getpid(),))
        filesystem_async._results_queue = _results_manager.Queue()


@contextlib.contextmanager
def children_may_outlive_parent():
    """Processes forked inside this block (and their own children) are not tied to their parent."""
    global _exempt
    previous, _exempt = _exempt, True
    try:
        yield
    finally:
        _exempt = previous


def tie_children_to_parent() -> None:
    """End an enclosing `children_may_outlive_parent()` early, for the rest of its block: used by
    the code a daemon-starting wrapper calls back into (the training itself)."""
    global _exempt
    _exempt = False
