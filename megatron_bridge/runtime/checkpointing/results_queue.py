"""Where megatron-core's checkpoint writer reports what it wrote.

The writer (`FileSystemWriterAsync`) runs its writing function in this process (a synchronous
save), in a process forked from it (a background save), or in a spawned persistent worker, and
the function puts its results on one module-level queue that the saving process reads. Left to
itself, megatron-core makes that queue a `multiprocessing` manager in a spawned process: seconds
on every job's first save (a fresh interpreter that re-imports the training script) and one more
process to outlive a killed trainer. Only the persistent worker, which receives the queue by
pickling, needs a manager; the other two cases get `ForkedResultsQueue`, which needs no process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
from typing import Any
from megatron_bridge.runtime.child_processes import die_when_parent_dies, die_with_parent

RESULT_WAIT_SECONDS = 10.0
"""How long a read waits for a result still on its way from a background writer that has
finished (it is read only once the writer has exited)."""

_forked_queue: Any = None
_manager_queue: Any = None
_manager: Any = None


class ForkedResultsQueue:
    """A results queue for writers in this process or in processes forked from it: `put` in this
    process goes straight onto an in-memory queue; in a forked process it goes over a pipe, which
    a thread of this process drains as results arrive (so a large result never blocks its
    writer, and the writer can exit before it is read)."""

    def __init__(self) -> None:
        ctx = mp.get_context("fork")
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._send_lock = ctx.Lock()
        self._owner = os.getpid()
        self._items: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, name="checkpoint-results", daemon=True).start()

    def put(self, item: Any) -> None:
        if os.getpid() == self._owner:
            self._items.put(item)
        else:
            with self._send_lock:
                self._writer.send(item)

    def get_nowait(self) -> Any:
        """The next result; raises `queue.Empty` when none comes within `RESULT_WAIT_SECONDS`."""
        return self._items.get(timeout=RESULT_WAIT_SECONDS)

    def _drain(self) -> None:
        while True:
            try:
                self._items.put(self._reader.recv())
            except (EOFError, OSError):
                return


def use_results_queue(persistent_worker: bool) -> None:
    """Give megatron-core's checkpoint writer the results queue for the next save:
    `ForkedResultsQueue` unless a persistent worker writes it (`checkpoint.async_save` with
    `use_persistent_ckpt_worker`), which gets a manager queue whose process dies with this one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _forked_queue, _manager_queue, _manager
    if not persistent_worker:
        if _forked_queue is None:
            _forked_queue = ForkedResultsQueue()
        filesystem_async._results_queue = _forked_queue
        return
    if _manager_queue is None:
        from multiprocessing.managers import SyncManager

        die_with_parent()
        # Spawned, not forked: forking a server from a trainer whose libraries run threads can crash it.
        _manager = SyncManager(ctx=mp.get_context("spawn"))
        _manager.start(initializer=die_when_parent_dies, initargs=(os.getpid(),))
        _manager_queue = _manager.Queue()
    filesystem_async._results_queue = _manager_queue
