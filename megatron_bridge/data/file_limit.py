"""Open files of a blend with many prefixes, against the process's open-file limit.

megatron-core keeps files open for as long as a dataset lives: three for each prefix of a blend
(the .idx map, the .bin file and its map) and three for each split a prefix is drawn into (the
document, sample and shuffle index maps of its cache). A blend of a few hundred prefixes passes
the common default limit of 1,024 open files (`ulimit -n`), and building the datasets failed
with "Too many open files" after the model was built. Before building, the soft limit is raised
as far as the hard limit allows; a blend that needs more than that is a config problem.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from megatron_bridge.config.errors import Problems

logger = logging.getLogger(__name__)

FILES_PER_PREFIX = 3
"""Files megatron-core's IndexedDataset keeps open: the .idx map, the .bin file and its map."""

FILES_PER_SPLIT = 3
"""Files a GPTDataset keeps open for one split of a prefix: its document, sample and shuffle index maps."""

HEADROOM = 256
"""Open files left for everything else (checkpoints, loggers, dataloader pipes, libraries)."""


def _open_now() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc (macOS): assume little is open
        return 0


def make_room_for_data_files(found: dict[str, tuple[int, int]], problems: Problems) -> Optional[int]:
    """Raise the soft open-file limit for the blend's datasets when they need it (up to the hard
    limit); a problem when even the hard limit is too small. `found`: `data.checks.files_needed`.
    Returns the limit raised to, or None."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    if not found:
        return None
    total = sum(files for _, files in found.values()) + _open_now() + HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or total <= soft:
        return None
    if hard != resource.RLIM_INFINITY and total > hard:
        path = max(found, key=lambda p: found[p][1])
        prefixes, files = found[path]
        problems.add(
            path,
            f"its {prefixes:,} prefixes keep about {files:,} files open while training ({FILES_PER_PREFIX} for each "
            f"prefix, {FILES_PER_SPLIT} more for each split drawn from it); with the rest of the run that is over "
            f"this process's limit of {hard:,} open files",
            "raise the limit where the job starts (`ulimit -n`; a scheduler's or container's own setting), or merge "
            "small prefixes into fewer, larger ones (`mbridge data preprocess` over their source files)",
        )
        return None
    raised = hard if hard != resource.RLIM_INFINITY else total
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    logger.info("raised the open-file limit from %d to %d: the blend's datasets keep about %d files open", soft, raised, total - HEADROOM)
    return raised
