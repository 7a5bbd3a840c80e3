"""Helper processes that die with the trainer.

megatron-core's checkpoint writer forks processes (a background saver, one writer per bucket).
If the trainer is killed with SIGKILL, nothing tells them to stop: they were re-parented to init
and lived on, holding hundreds of MB each. Here every process forked by the trainer asks Linux to
SIGKILL it when its parent dies (`PR_SET_PDEATHSIG`); spawned helpers (worker pools, the results
manager of a persistent checkpoint worker, megatron-core's persistent checkpoint worker itself)
do the same when they start.

Some helpers must outlive their parent on purpose: nvidia-resiliency-ext's restart monitor is
a daemon made by a double fork, whose middle process exits at once. They are started inside
`children_may_outlive_parent()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import multiprocessing as mp
import os
import signal
import sys
from typing import Any, Callable, Optional

_PR_SET_PDEATHSIG = 1
_installed = False
_parent_pid = 0
_exempt = False


def _load_prctl() -> Optional[Callable[..., int]]:
    # Looked up in the parent: loading libraries in a child forked from a threaded process can hang.
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def die_when_parent_dies(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when `parent_pid`, its parent, dies (exit at once if it has)."""
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
        die_when_parent_dies(_parent_pid)


def die_with_parent() -> None:
    """From now on, processes forked by this process are killed when it dies (Linux; elsewhere
    a no-op). Idempotent."""
    global _installed
    if _installed or _prctl is None:
        return
    os.register_at_fork(before=_before_fork, after_in_child=_in_child)
    _installed = True


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


def _start_worker(parent_pid: int, initializer: Callable[..., None], initargs: tuple) -> None:
    die_when_parent_dies(parent_pid)
    initializer(*initargs)


def tie_spawned_target(owner: type, name: str) -> None:
    """Processes spawned from now on with the target `owner.name` (a static method that the
    spawning code looks up when it starts the process, as megatron-core does for its persistent
    checkpoint worker) die when this process dies, and so do the processes they fork: otherwise
    such a worker, blocked on its job queue, outlives a killed trainer forever (on a GPU, with
    its CUDA context). Call again after a fork (the pid of the spawning process is recorded)."""
    setattr(owner, name, functools.partial(_run_tied, os.getpid(), owner, name))


def _run_tied(parent_pid: int, owner: type, name: str, *args: Any, **kwargs: Any) -> Any:
    die_when_parent_dies(parent_pid)
    die_with_parent()
    target = inspect.getattr_static(owner, name)  # the class as imported here: not tied
    if isinstance(target, functools.partial):
        raise RuntimeError(f"{owner.__qualname__}.{name} is tied in the spawned process too")
    return (target.__func__ if isinstance(target, staticmethod) else target)(*args, **kwargs)


def worker_pool(workers: int, initializer: Callable[..., None], initargs: tuple = ()) -> Any:
    """A `ProcessPoolExecutor` of `workers` spawned processes that die with this one.

    Spawned, not forked: a child forked from a process whose libraries run threads (pyarrow,
    tokenizers) can crash in its first garbage collection. An executor, not a `Pool`: a worker
    that dies anyway fails the pending work with `BrokenProcessPool` instead of hanging it.
    `initializer`, `initargs` and the submitted functions must be picklable (module level)."""
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(
        max_workers=workers,
        mp_context=mp.get_context("spawn"),
        initializer=_start_worker,
        initargs=(os.getpid(), initializer, initargs),
    )
