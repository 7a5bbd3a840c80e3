"""`finetune()`: continue training from pretrained weights."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from megatron_bridge.config.errors import ConfigValidationError, Problems
from megatron_bridge.runtime.callbacks import Callback
from megatron_bridge.training.checkpointing import has_checkpoint
from megatron_bridge.training.config import ConfigContainer
from megatron_bridge.training.state import GlobalState
from megatron_bridge.training.runner import run_job
from megatron_bridge.training.setup import resolve_config
from megatron_bridge.warning_filters import quiet_known_warnings


def finetune(config: ConfigContainer, forward_step_func: Callable, callbacks: Optional[Iterable[Callback]] = None) -> GlobalState:
    """Train from the weights in `checkpoint.pretrained_checkpoint` (a parent directory with a
    tracker file, or one `iter_*` directory): model weights only, the step count starts at 0. If
    `checkpoint.load` already holds a checkpoint of this fine-tuning run, it resumes from there
    instead. Otherwise as `pretrain()`.

    With `config.peft` (LoRA/DoRA), the pretrained weights are frozen and adapters train on them;
    resuming loads the pretrained weights first, then the adapters saved by this run.
    """
    quiet_known_warnings()

    problems = Problems()
    check_pretrained_weights(config, problems)
    if problems:  # reported together with the rest of the config's problems, in one round

        try:
            resolve_config(config)
        except ConfigValidationError as err:
            problems.absorb(err)
        problems.raise_if_any()
    return run_job(config, forward_step_func, callbacks)


def check_pretrained_weights(config: ConfigContainer, problems: Problems) -> None:
    """Fine-tuning needs weights to start from: `checkpoint.pretrained_checkpoint`, or a checkpoint
    of this run in `checkpoint.load` to resume."""
    ckpt = config.checkpoint
    problems.check(
        bool(ckpt.pretrained_checkpoint) or has_checkpoint(ckpt.load),
        "checkpoint.pretrained_checkpoint",
        "finetune() needs pretrained weights, and neither pretrained_checkpoint nor a resumable load is set",
        "set checkpoint.pretrained_checkpoint to a checkpoint directory (or use pretrain())",
    )
