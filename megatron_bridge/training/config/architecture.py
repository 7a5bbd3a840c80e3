"""Validation rules on the checkpoints a run loads weights from: they were saved with the config's
model architecture (`check_loaded_architectures`, from their run_config.yaml, before anything is
built), their pickled files name nothing but checkpoint data, and a `ckpt_step` names an
iteration that one of them is loaded from (`check_ckpt_step_is_loaded`). The architecture is
checked again when the weights are loaded (`megatron_bridge.training.checkpointing.compat`)."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from megatron_bridge.config.errors import Problems, show
from megatron_bridge.runtime.checkpointing.run_config import read_run_config
from megatron_bridge.config.serialization import to_dict
from megatron_bridge.runtime.checkpointing.layout import has_checkpoint, resolve
from megatron_bridge.runtime.checkpointing.safe_reading import UnsafeCheckpointError, check_pickled_files
from megatron_bridge.models.hf.files import is_hf_directory
from megatron_bridge.models.saved_architecture import describe, differing_fields

logger = logging.getLogger(__name__)

TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
"""Tokenizer fields that choose the token ids a model was trained on."""




def loaded_checkpoints(cfg: Any) -> list[tuple[str, str, Optional[int]]]:
    """(config field, path, ckpt_step) of each checkpoint of ours whose weights a run of `cfg`
    loads, as the checkpoint manager chooses them: a resumable `load`, else `pretrained_checkpoint`;
    a PEFT run loads both (the base, then its adapters)."""
    c = cfg.checkpoint
    resume = bool(c.load) and has_checkpoint(c.load)
    loads_base = cfg.peft is not None or not resume
    found = []
    if c.pretrained_checkpoint and not is_hf_directory(c.pretrained_checkpoint) and loads_base:
        found.append(("checkpoint.pretrained_checkpoint", c.pretrained_checkpoint, None if resume else c.ckpt_step))
    if resume:
        found.append(("checkpoint.load", c.load, c.ckpt_step))
    return found


def check_ckpt_step_is_loaded(cfg: Any, problems: Problems) -> None:
    """`ckpt_step` picks the iteration of a checkpoint of ours that the run loads. When the run
    loads none (`load` holds no checkpoint yet, and `pretrained_checkpoint` is unset or a Hugging
    Face directory), it would start from scratch as if the step had not been asked for; when the
    path is one `iter_*` directory, that directory's iteration is loaded, not the step."""
    c = cfg.checkpoint
    if c.ckpt_step is None or not (c.load or c.pretrained_checkpoint):
        return  # nothing to load at all: the checkpoint section reports it
    stepped = [(field, path) for field, path, step in loaded_checkpoints(cfg) if step is not None]
    if not stepped:
        where = [f"checkpoint.load={c.load!r} holds no checkpoint"] if c.load else []
        if c.pretrained_checkpoint:
            where.append(f"checkpoint.pretrained_checkpoint={c.pretrained_checkpoint!r} is a Hugging Face directory")
        problems.add(
            "checkpoint.ckpt_step",
            f"ckpt_step={c.ckpt_step} asks for a saved iteration, but {' and '.join(where)}: the run would start "
            "without it",
            f"point checkpoint.load at the run that saved iteration {c.ckpt_step}, or remove ckpt_step",
        )
        return
    for field, path in stepped:
        try:
            iteration = resolve(path, c.ckpt_step)[1]
        except (OSError, ValueError):
            continue  # no such iteration there: reported, with the ones there are, when it is loaded
        problems.check(
            iteration == c.ckpt_step,
            "checkpoint.ckpt_step",
            f"ckpt_step={c.ckpt_step}, but {field}={path!r} is the directory of iteration {iteration}",
            f"point {field} at the parent directory to pick an iteration, or remove ckpt_step",
        )


def check_loaded_architectures(cfg: Any, problems: Problems) -> None:
    """The checkpoints of ours that the run loads weights from were saved with the config's model
    architecture (their run_config.yaml against the model section): a mismatch is reported
    before the model is built. Which checkpoints: see `loaded_checkpoints`. Fields the config
    leaves to be derived later (the vocabulary size from a tokenizer) are compared at loading.
    A checkpoint whose `.metadata` names code to run is reported too (`safe_reading`)."""
    current = None  # encoded only when there is a saved model to compare with (rarely)
    for field, path, step in loaded_checkpoints(cfg):
        try:
            directory = resolve(path, step)[0]
            check_pickled_files(directory)
        except UnsafeCheckpointError as exc:
            problems.add(field, exc.problem, exc.fix)
            continue
        except (OSError, ValueError):
            continue  # no readable checkpoint there: reported when it is loaded
        try:
            run_config = read_run_config(directory)
            saved = run_config.section("model") if run_config is not None else {}
        except (OSError, ValueError):
            continue  # no readable checkpoint there: reported when it is loaded
        if not saved:
            continue  # a directory without our run config, or one without a model section
        if field == "checkpoint.load":
            _warn_of_another_tokenizer(path, run_config.section("tokenizer"), cfg.tokenizer)
        current = to_dict(cfg.model) if current is None else current
        fields = differing_fields(saved, current, "checkpoint", "config")
        if not fields:
            continue
        problems.add(
            field,
            f"{path!r} holds a {describe(saved)}, but the config's model is a {describe(current)} ({fields})",
            "point it at a checkpoint of this architecture, or use the checkpoint's model (e.g. the matching recipe)",
        )


def _warn_of_another_tokenizer(path: str, saved: dict, tokenizer: Any) -> None:
    """A run resumed with another tokenizer than its checkpoint's reads other token ids for the
    same text. The files may only have moved, so this is a warning, not an error."""
    def same(name: str, before: Any, now: Any) -> bool:
        if name != "tokenizer_type" and isinstance(before, str) and isinstance(now, str):
            return os.path.abspath(before) == os.path.abspath(now)
        return before == now

    changed = [
        f"{name} {show(saved.get(name))} -> {show(getattr(tokenizer, name))}"
        for name in TOKENIZER_FIELDS
        if name in saved and not same(name, saved[name], getattr(tokenizer, name))
    ]  # fmt: skip
    if changed:
        logger.warning(
            "resuming from %r with another tokenizer than it was trained with (tokenizer.%s): the same text "
            "becomes other token ids unless the files only moved; give the run's tokenizer to continue it",
            path, "; tokenizer.".join(changed),
        )
