"""Checks of the paths a config names, from their text alone (the filesystem is checked where
the run writes: `training.preflight`).

A field named like a path (`save`, `load`, `tensorboard_dir`, `save_config_filepath`, ...) whose
default is None takes None for "off"; an empty string there is not a path (it would name the
current directory, or nothing, depending on who reads it), so it is refused. A path component
longer than `NAME_MAX` bytes is refused too: no common filesystem stores such a name, and the
run would fail where it first creates the file. So is a control character (see `_CONTROL`), and
a byte that is not UTF-8 (a Latin-1 directory name): the checkpoint's run_config.yaml could not
be written, and the first save would fail after the training before it.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any

from megatron_bridge.config.errors import Problems, show
from megatron_bridge.config.schema import specs

NAME_MAX = 255
"""Longest file or directory name, in bytes, on the filesystems runs write to (ext4, XFS,
Lustre, GPFS, NFS)."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""Control characters: in a path that is printed (checkpoint and log lines), an escape sequence
would recolor or clear the terminal and a newline forge a log line."""

_BY_CLASS: dict[type, tuple[str, ...]] = {}
"""The path fields of each class (`FieldSpec.is_path`), looked up without a call: `check` runs
for every section of every update."""


def check(obj: Any, problems: Problems) -> None:
    """Add a problem for each path field of config `obj` that is empty, has a control character
    or has a component too long for a filesystem."""
    names = _BY_CLASS.get(obj.__class__)
    if names is None:
        names = _BY_CLASS[obj.__class__] = tuple(s.name for s in specs(obj.__class__).values() if s.is_path)
    values = obj.__dict__
    for name in names:
        value = values.get(name)
        if value.__class__ is not str:
            continue  # unset
        # the common case: a path too short for any name in it to reach NAME_MAX bytes (a
        # character takes at most 4 bytes in UTF-8)
        short = len(value) <= NAME_MAX // 4 or (len(value) <= NAME_MAX and value.isascii())
        control = _CONTROL.search(value)
        if control:
            problems.add(
                name,
                f"{show(value)} has a control character ({control.group()!r})",
                "use a path without control characters (they would reach terminals and logs as they are)",
            )
            continue
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:  # a byte the OS gave that is not UTF-8 (a lone surrogate here)
                byte = value[exc.start].encode(errors="surrogateescape")
                problems.add(
                    name,
                    f"{show(value)} has a byte that is not UTF-8 text ({byte!r})",
                    "use a path in UTF-8: the run writes its paths into UTF-8 files (run_config.yaml, tracker logs)",
                )
                continue
        if value and short and not value[0].isspace():
            continue
        if not value.strip():
            problems.add(name, f"{show(value)} is not a path", "give a path, or null to turn it off")
            continue
        part = next((p for p in value.split("/") if len(p.encode(errors="surrogateescape")) > NAME_MAX), "")
        if part:
            size = len(part.encode(errors="surrogateescape"))
            problems.add(
                name,
                f"the name {show(part[:40] + '...')} in it is {size:,} bytes, over the {NAME_MAX} bytes a "
                "filesystem allows for one file or directory name",
                "use shorter names",
            )


def file_kind(path: str) -> str:
    """What `path` is, for messages: 'a directory', 'a regular file', 'a FIFO (named pipe)', ..."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "missing" if not os.path.lexists(path) else "a broken link"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "a special file")
