"""Where checkpoints live on disk, and which one is the latest.

    <save>/latest_checkpointed_iteration.txt   the latest complete iteration (written last)
    <save>/iter_0000120/                        a complete checkpoint (shards, run_config.yaml)
    <save>/iter_0000140.incomplete/             a save in progress: never loaded

A checkpoint is written under its `.incomplete` name and renamed once every rank has finished;
only then does the tracker file move to it (replaced atomically). Killing a job at any moment
therefore leaves the previous checkpoint as the latest, intact.
"""

from __future__ import annotations

import os
import re
from typing import Optional

TRACKER_FILE = "latest_checkpointed_iteration.txt"
INCOMPLETE_SUFFIX = ".incomplete"
RUN_CONFIG_FILE = "run_config.yaml"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def iteration_of_dir(path: str) -> Optional[int]:
    """The iteration of an `iter_*` checkpoint directory, or None for any other path."""
    match = _ITER_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match and os.path.isdir(path) else None


def read_tracker(root: str) -> Optional[int]:
    """The latest complete iteration recorded in `root`, or None."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{path}: expected an iteration number, found {text!r}")
    return int(text)


def write_tracker(root: str, iteration: int) -> None:
    """Point the tracker at `iteration`, atomically (a reader sees the old or the new value)."""
    path = os.path.join(root, TRACKER_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_iterations(root: str) -> list[int]:
    """Iterations with a complete checkpoint directory under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _ITER_DIR.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def has_checkpoint(root: Optional[str]) -> bool:
    return bool(root) and read_tracker(root) is not None


def checkpoint_below(path: str) -> Optional[str]:
    """A directory right under `path` that holds checkpoints (a run directory's `checkpoints/`
    first), or None: where a user who named the run directory meant to point."""
    if not os.path.isdir(path):
        return None
    try:
        names = sorted(os.listdir(path), key=lambda n: (n != "checkpoints", n))
    except OSError:
        return None
    for name in names:
        child = os.path.join(path, name)
        try:
            if os.path.isdir(child) and has_checkpoint(child):
                return child
        except (OSError, ValueError):
            continue  # an unreadable or odd tracker: not a place to suggest
    return None


PEFT_LIBRARY_CONFIG = "adapter_config.json"
"""The file of an adapter directory in the peft library's format (`mbridge peft export` writes one)."""


def no_checkpoint_message(path: str) -> str:
    """Why `path` holds no checkpoint to load, and where one is when the mistake is plain."""
    if not os.path.lexists(path):
        return f"no checkpoint in {path!r}: it does not exist (a typo, or a path relative to another directory?)"
    message = f"no checkpoint in {path!r}: no {TRACKER_FILE} and not an iter_* directory"
    below = checkpoint_below(path)
    if below is not None:
        return f"{message}; did you mean {below!r}? (it holds one)"
    iterations = complete_iterations(path)
    if iterations:
        return f"{message}; give one of its iterations, e.g. {iteration_dir(path, iterations[-1])!r}"
    if os.path.isdir(path) and any(n.endswith(INCOMPLETE_SUFFIX) for n in os.listdir(path)):
        return f"{message}; its only save did not finish (a run still saving, or one stopped while saving)"
    if os.path.isfile(os.path.join(path, PEFT_LIBRARY_CONFIG)):
        return (
            f"{message}; it holds adapters in the peft library's format ({PEFT_LIBRARY_CONFIG}), which load onto "
            "the Hugging Face base model with peft.PeftModel.from_pretrained: give the LoRA/DoRA run's checkpoint "
            "directory instead (its checkpoints/)"
        )
    return message


def resolve(path: str, step: Optional[int] = None) -> tuple[str, int]:
    """The checkpoint directory and iteration to load from `path`.

    `path` is a parent directory (its tracker names the latest iteration, or `step` picks one) or
    a single `iter_*` directory. Raises FileNotFoundError with what was looked for.
    """
    name = os.path.basename(os.path.normpath(path))
    match = _ITER_DIR.match(name)
    if match and os.path.isdir(path):
        return path, int(match.group(1))
    if step is not None:
        directory = iteration_dir(path, step)
        if not os.path.isdir(directory):
            available = complete_iterations(path)
            raise FileNotFoundError(f"no checkpoint for ckpt_step={step} in {path!r} (complete iterations: {available})")
        return directory, step
    latest = read_tracker(path)
    if latest is None:
        raise FileNotFoundError(no_checkpoint_message(path))
    directory = iteration_dir(path, latest)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{path!r}: the tracker names iteration {latest}, but {directory!r} is missing")
    return directory, latest
