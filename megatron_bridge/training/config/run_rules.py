"""Rules between sections that Megatron-LM enforces and a config must follow before a run starts:
FP8 parameters and their gathering, context-parallel fine-tuning losses, the schedule's length,
and the number of iterations of sample-based training with a batch-size ramp-up.

The `check_*` functions only report; `sample_based_train_iters` and `samples_after` count a
ramp-up's iterations and samples for the training section and the scheduler steps.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from megatron_bridge.config.base import ConfigBase
from megatron_bridge.config.errors import Problems
from megatron_bridge.runtime.checkpointing.run_config import find_run_config
from megatron_bridge.data.config import FinetuningDatasetConfig

if TYPE_CHECKING:
    from megatron_bridge.training.config.container import ConfigContainer

logger = logging.getLogger(__name__)


def sample_based_train_iters(train_samples: int, global_batch_size: int, rampup_batch_size: Optional[list[int]]) -> int:
    """Iterations of a run given in samples, as Megatron-LM counts them: whole global batches only
    (a partial last batch is dropped), and with a ramp-up, every ramp-up step at its own batch
    size, then the full batch size."""
    if rampup_batch_size is None:
        return train_samples // global_batch_size
    start, increment, rampup_samples = rampup_batch_size
    increments = max((global_batch_size - start) // increment, 1)
    samples_per_increment = rampup_samples / increments
    iterations = consumed = 0
    while consumed <= rampup_samples and consumed <= train_samples:
        steps = int(consumed / samples_per_increment)
        consumed += min(start + steps * increment, global_batch_size)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch_size
    return iterations


def samples_after(iterations: int, global_batch_size: int, rampup_batch_size: Optional[list[int]]) -> int:
    """Samples consumed by the first `iterations` iterations. With a ramp-up, each iteration's
    batch is the one megatron-core's `RampupBatchsizeNumMicroBatchesCalculator` gives for the
    samples consumed before it (start + increment x int(consumed / samples per increment) while
    consumed <= the ramp's samples, then global_batch_size)."""
    if rampup_batch_size is None or iterations <= 0:
        return max(iterations, 0) * global_batch_size
    start, increment, rampup_samples = rampup_batch_size
    per_increment = rampup_samples / ((global_batch_size - start) // increment)
    consumed = done = 0
    while done < iterations and consumed <= rampup_samples:
        step = int(consumed / per_increment)
        size = start + step * increment

        def same_size(j: int, c0: int = consumed, size: int = size, step: int = step) -> bool:
            c = c0 + j * size
            return c <= rampup_samples and int(c / per_increment) == step

        # Iterations at this size: the batch stays while the consumed count keeps the same
        # ramp step (a monotone condition, so the last such iteration is found by bisection).
        low, high = 0, (rampup_samples - consumed) // size + 1  # same_size(low), not same_size(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if same_size(mid) else (low, mid)
        run = min(low + 1, iterations - done)
        consumed += run * size
        done += run
    return consumed + (iterations - done) * global_batch_size


def check_fp8_param_sync(cfg: "ConfigContainer", problems: Problems) -> None:
    """model.fp8_param (parameters stored in FP8) and ddp.fp8_param_gather (gathered in FP8) are one
    decision in Megatron-LM (`--fp8-param-gather` sets both); disagreeing, the gathered buffers
    and the parameters would have different dtypes."""
    model_value = bool(getattr(cfg.model, "fp8_param", False))
    ddp_value = bool(cfg.ddp.fp8_param_gather)
    problems.check(
        model_value == ddp_value,
        "ddp.fp8_param_gather",
        f"{ddp_value} but model.fp8_param={model_value}",
        "set both alike (mixed_precision.fp8_param_gather sets both)",
    )


def check_fp8_param_gather_optimizer(cfg: "ConfigContainer", problems: Problems) -> None:
    """Gathering parameters in FP8 (Megatron-LM's `--fp8-param-gather`) happens in the
    distributed optimizer's parameter all-gather; megatron-core's plain optimizer has no such
    path. A named preset turns it on only with the distributed optimizer, so what is left here
    was set by the user."""
    if not cfg.ddp.fp8_param_gather or cfg.ddp.use_distributed_optimizer:
        return
    for name, attr in (("mixed_precision", "fp8_param_gather"), ("ddp", "fp8_param_gather"), ("model", "fp8_param")):
        section = getattr(cfg, name)
        if isinstance(section, ConfigBase) and section.is_explicit(attr) and getattr(section, attr):
            where = f"{name}.{attr}"  # the first field the user set
            break
    else:
        where = "ddp.fp8_param_gather"
    problems.add(
        where,
        "True asks for parameters gathered in FP8, which needs the distributed optimizer (megatron-core "
        "gathers parameters only there), but ddp.use_distributed_optimizer=False",
        f"set ddp.use_distributed_optimizer=True, or {where}=False",
    )


def check_mxfp8_param_gather_reuse(cfg: "ConfigContainer", problems: Problems) -> None:
    """MXFP8 parameters gathered in FP8 reuse the gradient buffer for the all-gather (NVIDIA
    Megatron Bridge requires it; without it megatron-core keeps a second buffer, a large amount
    of extra GPU memory). The mxfp8 presets set it."""
    mxfp8 = getattr(cfg.model, "fp8", None) and getattr(cfg.model, "fp8_recipe", None) == "mxfp8"
    if not (mxfp8 and cfg.ddp.fp8_param_gather) or cfg.ddp.reuse_grad_buf_for_mxfp8_param_ag:
        return
    where = "ddp.reuse_grad_buf_for_mxfp8_param_ag"
    mp = cfg.mixed_precision
    if isinstance(mp, ConfigBase) and not cfg.ddp.is_explicit("reuse_grad_buf_for_mxfp8_param_ag"):
        where = "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag"
    problems.add(
        where,
        "False, but MXFP8 parameters are gathered in FP8 (fp8_param_gather=True, fp8_recipe='mxfp8'), which "
        "reuses the gradient buffer for the all-gather",
        f"set {where}=True, or fp8_param_gather=False",
    )


def check_param_gather_with_optimizer_step(cfg: "ConfigContainer", problems: Problems) -> None:
    """Starting the parameter all-gather inside the optimizer step (Megatron-LM's rule): the
    distributed optimizer gathers the parameters, overlapped, and the first model chunk gathers
    during the step while later chunks gather in their forward, so there must be later chunks
    (virtual pipelining). megatron-core fails with an IndexError otherwise."""
    if not cfg.optimizer.overlap_param_gather_with_optimizer_step:
        return
    vp = cfg.model.virtual_pipeline_model_parallel_size or 1
    missing = [
        what
        for what, ok in (
            ("ddp.use_distributed_optimizer=True", cfg.ddp.use_distributed_optimizer),
            ("ddp.overlap_param_gather=True", cfg.ddp.overlap_param_gather),
            ("model.virtual_pipeline_model_parallel_size > 1", vp > 1),
        )
        if not ok
    ]
    problems.check(
        not missing,
        "optimizer.overlap_param_gather_with_optimizer_step",
        "needs " + ", ".join(missing),
        "set those too, or turn overlap_param_gather_with_optimizer_step off",
    )


def check_context_parallel_finetuning(cfg: "ConfigContainer", problems: Problems) -> None:
    """With context parallelism each rank holds part of every sequence. A fine-tuning loss counts
    only answer tokens, which are spread unevenly over the CP ranks; averaging per rank (or in the
    collective) weighs the ranks equally and biases the loss. The loss must be summed over tokens
    and divided by the global token count."""
    if cfg.model.context_parallel_size <= 1 or not isinstance(cfg.dataset, FinetuningDatasetConfig):
        return
    cp = cfg.model.context_parallel_size
    problems.check(
        bool(cfg.model.calculate_per_token_loss),
        "model.calculate_per_token_loss",
        f"fine-tuning with context_parallel_size={cp} needs the per-token loss "
        "(the answer tokens are spread unevenly over the CP ranks)",
        "set model.calculate_per_token_loss=True",
    )
    problems.check(
        not cfg.ddp.average_in_collective,
        "ddp.average_in_collective",
        f"fine-tuning with context_parallel_size={cp} sums the loss over tokens; averaging in the "
        "gradient collective would divide it again",
        "set ddp.average_in_collective=False",
    )


def check_schedule_length(cfg: "ConfigContainer", problems: Problems) -> None:
    """A schedule shorter than the run would leave the last iterations at the final LR without
    anyone having asked for it; refused (Megatron-LM only warns) because it is almost always a
    leftover of a shorter run. A longer schedule (a job doing the first part of a run) is fine."""
    s, t = cfg.scheduler, cfg.train
    if s.max_steps is None or t.train_iters is None or t.train_samples is not None:
        return
    problems.check(
        s.max_steps >= t.train_iters,
        "scheduler.max_steps",
        f"{s.max_steps} iterations is shorter than train.train_iters={t.train_iters}",
        f"raise scheduler.max_steps to at least {t.train_iters}, or unset it (it defaults to train_iters)",
    )


def check_warmup_start(cfg: "ConfigContainer", problems: Problems) -> None:
    """The warmup starts at or below the peak LR: megatron-core's scheduler refuses a higher
    start (whether or not there is a warmup)."""
    start, peak = cfg.scheduler.lr_warmup_init, cfg.optimizer.lr
    if peak is None:
        return  # reported by the optimizer
    problems.check(
        start <= peak,
        "scheduler.lr_warmup_init",
        f"the warmup starts at {start}, above the peak learning rate optimizer.lr={peak}",
        f"set scheduler.lr_warmup_init to at most {peak} (0.0 warms up from zero)",
    )


def derive_recipe_warmup(cfg: "ConfigContainer", problems: Problems) -> None:
    """A warmup that came as a default (a recipe's, not set by the user) and is not shorter than
    the decay is scaled down to a tenth of the decay, and the change is logged: a recipe's 2000
    warmup iterations are meant for its full-length run, not for a 1000-iteration one. A warmup
    the user set is kept, and the schedule check reports it. In sample-based training (a recipe
    switched to train.train_samples) such a warmup becomes the samples of its iterations, as
    the scheduler there counts in samples."""
    s, t = cfg.scheduler, cfg.train
    if t.train_samples is not None:
        _recipe_warmup_in_samples(s, t)
        return
    if not t.train_iters or s.lr_warmup_fraction is not None:
        return
    decay = s.lr_decay_iters or s.max_steps or t.train_iters
    if s.is_explicit("lr_warmup_iters") or s.lr_warmup_iters < decay:
        return
    scaled = decay // 10
    logger.info(
        "scheduler.lr_warmup_iters: the recipe's warmup of %d iterations is not shorter than the "
        "%d-iteration decay; using %d (a tenth of it). Set scheduler.lr_warmup_iters to choose.",
        s.lr_warmup_iters, decay, scaled,
    )
    s._derive("lr_warmup_iters", scaled)


def _recipe_warmup_in_samples(s: Any, t: Any) -> None:
    if s.is_explicit("lr_warmup_iters") or not s.lr_warmup_iters or s.lr_warmup_fraction is not None:
        return
    if s.is_explicit("lr_warmup_samples") or not t.global_batch_size:
        return
    decay = s.lr_decay_samples or t.train_samples
    samples = s.lr_warmup_iters * t.global_batch_size
    if samples >= decay:
        samples = decay // 10
    logger.info(
        "scheduler.lr_warmup_iters: the recipe's warmup of %d iterations, in sample-based training, is a "
        "warmup of %d samples. Set scheduler.lr_warmup_samples to choose.",
        s.lr_warmup_iters, samples,
    )
    # Framework values, not derived ones: the next resolution (or a reload of the saved config)
    # keeps the converted warmup instead of finding it in iterations and samples at once.
    s.apply_default("lr_warmup_iters", 0)
    s.apply_default("lr_warmup_samples", samples)


SCHEDULE_FIELDS = (
    ("scheduler", "lr_decay_style"),
    ("scheduler", "lr_decay_steps"),
    ("scheduler", "lr_warmup_steps"),
    ("scheduler", "wd_incr_steps"),
    ("scheduler", "weight_decay_incr_style"),
    ("scheduler", "start_weight_decay"),
    ("scheduler", "end_weight_decay"),
    ("optimizer", "lr"),
    ("optimizer", "min_lr"),
)
"""What megatron-core's scheduler compares with a checkpoint's when it resumes."""


def derive_resume_schedule(cfg: "ConfigContainer", problems: Problems) -> None:
    """Resuming with a schedule other than the checkpoint's (typically: a finished run extended,
    train_iters 30 -> 40) is decided here, before anything is built. By default the schedule
    follows this config (scheduler.override_opt_param_scheduler, logged with the differences);
    `use_checkpoint_opt_param_scheduler=True` continues the checkpoint's instead; an explicit
    `override_opt_param_scheduler=False` with a different schedule is an error."""
    c, s = cfg.checkpoint, cfg.scheduler
    if not c.load or c.finetune or s.use_checkpoint_opt_param_scheduler:
        return
    if s.override_opt_param_scheduler and s.is_explicit("override_opt_param_scheduler"):
        return
    saved = find_run_config(c.load, c.ckpt_step) if os.path.isdir(c.load) else None  # a first run: one stat
    if saved is None:
        return
    differences = []
    for section, name in SCHEDULE_FIELDS:
        before = saved.value(section, name)
        now = getattr(getattr(cfg, section), name)
        if before is not None and now is not None and before != now:
            differences.append(f"{section}.{name} {before!r} -> {now!r}")
    if not differences:
        return
    why = ", ".join(differences)
    saved_iters = saved.value("train", "train_iters")
    if saved_iters is not None and saved_iters != cfg.train.train_iters:
        why = f"train.train_iters {saved_iters} -> {cfg.train.train_iters}: {why}"
    if s.is_explicit("override_opt_param_scheduler"):
        problems.add(
            "scheduler.override_opt_param_scheduler",
            f"False, but the schedule differs from the checkpoint's in {c.load!r} ({why})",
            "set scheduler.override_opt_param_scheduler=True to follow this config's schedule, or "
            "scheduler.use_checkpoint_opt_param_scheduler=True to continue the checkpoint's",
        )
        return
    logger.info(
        "resuming from %s with a different schedule (%s): the schedule follows this config "
        "(scheduler.override_opt_param_scheduler=True); set scheduler.use_checkpoint_opt_param_scheduler=True "
        "to continue the checkpoint's instead",
        c.load, why,
    )
    s._derive("override_opt_param_scheduler", True)
