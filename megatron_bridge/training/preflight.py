"""Checks of where a run writes (and the checkpoint it resumes from), done before the model is built.

A save directory that cannot be written would otherwise be found at the first save, which with
most recipes comes after hours of training. Every output directory the config names is checked:
it must be a directory (or creatable: its nearest existing ancestor is a writable directory), and
writable. A real run creates it and writes a probe file; a dry run only inspects, and reports what
would fail "on this machine". Free space below one checkpoint's estimated size is a warning.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import TYPE_CHECKING, Optional

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.config.paths import file_kind
from megatron_bridge.runtime.checkpointing import layout
from megatron_bridge.runtime.writable import unwritable_reason
from megatron_bridge.training.config.architecture import loaded_checkpoints
from megatron_bridge.training.profiling import default_profile_dir
from megatron_bridge.models import count_parameters

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer

logger = logging.getLogger("megatron_bridge")


def output_dirs(cfg: "ConfigContainer", logging_rank: bool = True) -> list[tuple[str, str]]:
    """(dotted field, directory) for every directory this rank writes into. Checkpoints are
    written by every rank; tracker, config and profile files by the logging rank."""
    out: list[tuple[str, str]] = []
    if cfg.checkpoint.save:
        out.append(("checkpoint.save", cfg.checkpoint.save))
    if not logging_rank:
        return out
    log = cfg.logger
    for name in ("tensorboard_dir", "wandb_save_dir", "comet_offline_directory"):
        value = getattr(log, name)
        if value:
            out.append((f"logger.{name}", value))
    uri = log.mlflow_tracking_uri or ""
    if uri.startswith("sqlite:///"):
        out.append(("logger.mlflow_tracking_uri", os.path.dirname(os.path.abspath(uri[len("sqlite:///") :]))))
    elif uri.startswith("file://"):
        out.append(("logger.mlflow_tracking_uri", uri[len("file://") :]))
    if getattr(log, "save_config_filepath", None):
        out.append(("logger.save_config_filepath", os.path.dirname(os.path.abspath(log.save_config_filepath))))
    if cfg.profiling.use_pytorch_profiler:
        out.append(("profiling.profile_dir", default_profile_dir(cfg)))
    return out


def check_outputs(cfg: "ConfigContainer", create: bool, logging_rank: bool = True) -> list[ConfigProblem]:
    """A problem for each output directory of this rank that cannot be written, and for the
    checkpoints the run starts from (`check_inputs`)."""
    problems = check_inputs(cfg)
    for field, path in output_dirs(cfg, logging_rank):
        why = unwritable_reason(path, create)
        if why:
            problems.append(ConfigProblem(field, why, "choose a writable directory"))
    return problems


def check_inputs(cfg: "ConfigContainer") -> list[ConfigProblem]:
    """A `checkpoint.load` that is not a directory, a run directory whose `checkpoints/` holds
    the checkpoints, or one `iter_*` directory (each way the run would silently start from
    scratch); a
    `pretrained_checkpoint` directory that holds no checkpoint (the run would fail at loading)."""
    problems = []
    c = cfg.checkpoint
    if c.load and os.path.exists(c.load) and not os.path.isdir(c.load):
        problems.append(ConfigProblem(
            "checkpoint.load", f"{c.load} is {file_kind(c.load)}, not a checkpoint directory",
            "point it at the directory the checkpoints were saved to (the earlier run's checkpoint.save)",
        ))  # fmt: skip
    elif c.load and not _holds_checkpoint(c.load) and _holds_checkpoint(os.path.join(c.load, "checkpoints")):
        below = os.path.join(c.load, "checkpoints")
        problems.append(ConfigProblem(
            "checkpoint.load", f"{c.load!r} holds no checkpoint, so the run would start from scratch, but {below!r} holds one",
            f"set checkpoint.load={below} to resume from it, or name an empty directory to start afresh",
        ))  # fmt: skip
    elif c.load and not _holds_checkpoint(c.load) and layout.iteration_of_dir(c.load) is not None:
        parent, iteration = os.path.dirname(os.path.normpath(c.load)), layout.iteration_of_dir(c.load)
        problems.append(ConfigProblem(
            "checkpoint.load", f"{c.load!r} is the directory of iteration {iteration}, not a save directory with a "
            "tracker, so the run would start from scratch",
            f"set checkpoint.load={parent} and checkpoint.ckpt_step={iteration} to resume from it, or "
            f"checkpoint.pretrained_checkpoint={c.load} to start from its weights",
        ))  # fmt: skip
    try:
        loaded = loaded_checkpoints(cfg)  # which ones a run loads, as the checkpoint manager chooses
    except (OSError, ValueError):
        loaded = []  # an unreadable tracker in checkpoint.load: reported when it is loaded
    for field, path, step in loaded:
        resuming = field == "checkpoint.load"
        if (resuming and step is None) or not os.path.isdir(path):
            continue  # a resumable `load` holds its latest checkpoint
        try:
            layout.resolve(path, step)
        except FileNotFoundError as exc:
            fix = "point it at a checkpoint directory, one of its iter_* directories or a Hugging Face model directory"
            if resuming:
                field, fix = "checkpoint.ckpt_step", "choose one of the complete iterations, or remove it to load the latest"
            problems.append(ConfigProblem(field, str(exc), fix))
        except (OSError, ValueError):
            pass  # an unreadable tracker: reported when it is loaded
    return problems


class MissingCheckpointError(ConfigValidationError, FileNotFoundError):
    """The checkpoint a run would load is not on disk: a config problem, and the
    FileNotFoundError that loading it raises."""


def raise_problems(problems: list[ConfigProblem]) -> None:
    """Raise `problems` (if any) as one `ConfigValidationError`; a `MissingCheckpointError` when
    one of them is a checkpoint that is not there."""
    if problems:
        missing = any(p.path in ("checkpoint.ckpt_step", "checkpoint.pretrained_checkpoint") for p in problems)
        raise (MissingCheckpointError if missing else ConfigValidationError)(problems)


def _holds_checkpoint(path: Optional[str]) -> bool:
    try:
        return layout.has_checkpoint(path)
    except (OSError, ValueError):
        return False  # an unreadable tracker: reported when it is loaded


def checkpoint_bytes(cfg: "ConfigContainer") -> int:
    """Estimated size of one checkpoint of the whole job: weights in their dtype, plus fp32 main
    weights and two Adam moments per parameter when the optimizer state is saved."""
    import torch

    if not cfg.model.vocab_size:
        return 0
    params = count_parameters(cfg.model).total
    weight = torch.tensor([], dtype=cfg.model.params_dtype).element_size()
    optimizer = 12 if cfg.checkpoint.save_optim else 0
    return params * (weight + optimizer)


def free_space_warning(cfg: "ConfigContainer") -> Optional[str]:
    """A warning when the save directory's filesystem has less free space than the new
    checkpoints this run holds there at once (`new_checkpoints_at_once`)."""
    save = cfg.checkpoint.save
    if not save:
        return None
    existing = os.path.abspath(save)
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        free = shutil.disk_usage(existing).free
        needed = checkpoint_bytes(cfg)
        count, why = new_checkpoints_at_once(cfg)
    except (OSError, ValueError):
        return None
    if not needed or free >= needed * count:
        return None
    if free < needed:
        return (
            f"checkpoint.save: {save} has {human_bytes(free)} free, but one checkpoint of this model takes "
            f"about {human_bytes(needed)}; saves will fail unless space is freed"
        )
    return (
        f"checkpoint.save: {save} has {human_bytes(free)} free, but this run holds up to {count} new checkpoints "
        f"of about {human_bytes(needed)} each there at once ({why}), {human_bytes(needed * count)} in all; "
        "a save partway through the run will fail unless space is freed or checkpoint.most_recent_k is lowered"
    )


def new_checkpoints_at_once(cfg: "ConfigContainer") -> tuple[int, str]:
    """(the most checkpoints this run adds to its save directory that exist at the same time, why).
    A checkpoint is written before the old ones beyond `most_recent_k` are deleted, so k kept
    ones plus the one being written exist at once; the complete checkpoints already there count
    towards the k. With most_recent_k=-1 every save of the run is kept."""
    c, t = cfg.checkpoint, cfg.train
    start = layout.read_tracker(c.save) or 0  # a run resumes where its own checkpoints end
    interval = c.save_interval
    saves = 1
    if interval and t.train_iters:  # interval saves, and one at the end when it is not one of them
        saves = max(t.train_iters // interval - start // interval + (1 if t.train_iters % interval else 0), 1)
    if c.most_recent_k is None or c.most_recent_k < 1:
        return saves, f"checkpoint.most_recent_k={c.most_recent_k} keeps all {saves} saves"
    present = len(layout.complete_iterations(c.save))
    count = max(1, min(saves, c.most_recent_k + 1 - present))
    return count, f"checkpoint.most_recent_k={c.most_recent_k} kept, plus the one being written"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def is_out_of_space(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a write that failed for lack of space. torch's
    checkpoint writer reports a short write as 'unexpected pos'."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "unexpected pos" in str(exc) or "No space left" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class CheckpointSpaceError(OSError):
    """A checkpoint could not be written because its filesystem is full."""


def out_of_space_error(cfg: "ConfigContainer", iteration: int, exc: BaseException) -> CheckpointSpaceError:
    save = cfg.checkpoint.save
    try:
        usage = shutil.disk_usage(save)
        space = f"{human_bytes(usage.free)} free of {human_bytes(usage.total)}"
    except OSError:
        space = "free space unknown"
    needed = checkpoint_bytes(cfg)
    return CheckpointSpaceError(
        errno.ENOSPC,
        f"saving the checkpoint of iteration {iteration} to {save} failed: no space left on the device "
        f"({space}; one checkpoint takes about {human_bytes(needed)}). The previous checkpoint is intact and the "
        f"partly written one removed; free space or point checkpoint.save elsewhere, then resume. "
        f"({type(exc).__name__}: {str(exc)[:200]})",
    )
