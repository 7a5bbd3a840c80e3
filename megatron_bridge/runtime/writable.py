"""Whether files can be written into a directory, checked before a long job writes there.

A job that finds an unwritable output only when it writes (a checkpoint after hours of training,
a converted model after loading every weight) has spent that time for nothing; the commands and
the training preflight (`training.preflight`) ask here first.
"""

from __future__ import annotations

import os
import stat
import tempfile
from typing import Optional


def unwritable_reason(path: str, create: bool) -> Optional[str]:
    """Why files cannot be written into directory `path`, or None. With `create`, the directory
    is created and a probe file written and removed (the only test that is exact, e.g. for root on
    a read-only filesystem); otherwise only permissions and mount flags are inspected."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path):
        mode = os.stat(path).st_mode
        if not stat.S_ISDIR(mode):
            kind = "a file" if stat.S_ISREG(mode) else "a device or special file" if not stat.S_ISLNK(mode) else "a link"
            return f"{path} is {kind}, not a directory"
        existing = path
    else:
        existing = os.path.dirname(path)
        while existing and not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if existing and not os.path.isdir(existing):
            return f"{path} lies under {existing}, which is a file, not a directory"
    long_name = _name_too_long(path, existing) or _path_too_long(path, existing)
    if long_name:
        return long_name
    if not create:
        if not os.access(existing, os.W_OK | os.X_OK):
            return f"{existing} is not writable by this user"
        try:
            if os.statvfs(existing).f_flag & os.ST_RDONLY:
                return f"{existing} is on a read-only filesystem"
        except OSError:
            pass
        return None
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{path} cannot be written: {exc.strerror or exc}"
    return None


def _name_too_long(path: str, existing: str) -> Optional[str]:
    """Why a name in `path` is longer than the filesystem of its nearest existing directory
    `existing` stores, or None."""
    try:
        limit = os.pathconf(existing or "/", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for part in path.split(os.sep):
        size = len(os.fsencode(part))
        if size > limit:
            return f"{path}: the name {part[:40]!r}... is {size} bytes, over the {limit} bytes its filesystem allows"
    return None


INSIDE_BYTES = 128
"""Room left for what is written inside an output directory (`iter_0000200.incomplete/__0_0.distcp`,
`events.out.tfevents.<time>.<host name>.<pid>...`): a directory whose own path takes nearly all of PATH_MAX
could be made, and the first checkpoint saved into it would fail."""


def _path_too_long(path: str, existing: str) -> Optional[str]:
    """Why `path`, with room for the files written inside it, is longer than the system's
    PATH_MAX, or None."""
    try:
        limit = os.pathconf(existing or "/", "PC_PATH_MAX")
    except (OSError, ValueError):
        limit = 4096
    size = len(os.fsencode(path))
    if size + INSIDE_BYTES >= limit:
        return (
            f"{path[:60]}...: the path is {size:,} bytes; with the names written inside it (up to {INSIDE_BYTES} "
            f"bytes more) it passes the {limit:,} bytes this system allows for a path"
        )
    return None
