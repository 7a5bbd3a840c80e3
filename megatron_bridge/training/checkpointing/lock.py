"""One job per save directory: an exclusive lock on `<save>/.mbridge.lock`.

Two jobs saving into one directory would overwrite each other's checkpoints and trackers. The
first job takes an `flock` on the lock file and writes its host and PID into it; a second job
finds the lock held and is refused, with the holder named. The file is removed when the job ends.
The kernel releases an `flock` when its holder dies, however it dies, so a lock file left by a
killed job is simply taken over.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from typing import Optional

logger = logging.getLogger("megatron_bridge")

LOCK_FILE = ".mbridge.lock"

_held: dict[str, int] = {}
"""Lock path -> file descriptor, for locks this process holds (taking one twice reuses it)."""


class SaveDirectoryInUse(RuntimeError):
    """Another live job holds the lock of the save directory."""


def acquire(save_dir: str) -> str:
    """Lock `save_dir` for this process (created if missing); return the lock path. Raises
    `SaveDirectoryInUse` naming the holder if another process has it."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(os.path.abspath(save_dir), LOCK_FILE)
    if path in _held:
        return path
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise SaveDirectoryInUse(
                f"checkpoint.save={save_dir} is in use by another job ({holder or 'holder unknown'}); "
                "wait for it to end, or give this job its own checkpoint.save"
            ) from None
        try:
            same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            break
        os.close(fd)  # the holder removed the file while we opened it: lock the new one
    previous = _read(fd)
    if previous:
        logger.info("taking over the lock of %s left by a job that is no longer running (%s)", save_dir, previous)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host={socket.gethostname()} pid={os.getpid()} since={time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    _held[path] = fd
    return path


def release(path: Optional[str]) -> None:
    """Release a lock taken by `acquire` and remove its file (removed while still locked, so a
    job that opens it meanwhile sees a deleted file and retries)."""
    fd = _held.pop(path, None) if path else None
    if fd is None:
        return
    try:
        os.unlink(path)
    except OSError:
        pass
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        return ""
