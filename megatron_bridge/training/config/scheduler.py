"""Learning-rate and weight-decay schedule.

The schedule is stepped in samples (megatron-core's `OptimizerParamScheduler` is advanced by the
global batch size each iteration). Users give lengths in iterations *or* in samples; the derived
`*_steps` fields, in samples, are computed by `ConfigContainer.validate()` because they need the
training length and batch size.
"""

from __future__ import annotations

from typing import Literal, Optional

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import LEARNING_RATE, PROBABILITY, STEPS, WEIGHT_DECAY, field

ITERATION_FIELDS = ("lr_decay_iters", "lr_wsd_decay_iters", "lr_warmup_iters", "max_steps")
SAMPLE_FIELDS = ("lr_decay_samples", "lr_wsd_decay_samples", "lr_warmup_samples")


@config_dataclass(kw_only=True)
class SchedulerConfig(ConfigBase):
    """Configuration settings for the learning rate scheduler and weight decay."""

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """Shape of the decay from optimizer.lr to optimizer.min_lr after warmup."""

    lr_decay_iters: Optional[int] = field(None, range="[1, 2**63)")  # 0 would be no decay period at all
    """Iterations over which to decay the LR (unset: the schedule length, max_steps or train_iters,
    which validate() fills in)."""

    lr_decay_samples: Optional[int] = field(None, range="[1, 2**63)")  # 0 would be no decay period at all
    """Samples over which to decay the LR (sample-based training; unset: train_samples, which
    validate() fills in)."""

    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """Shape of the final decay phase of the warmup-stable-decay (WSD) schedule."""

    lr_wsd_decay_iters: Optional[int] = field(None, range=STEPS)
    """Iterations of the final decay phase of WSD (unset: the whole decay, lr_decay_iters, which
    validate() fills in, as NVIDIA Megatron Bridge does)."""

    lr_wsd_decay_samples: Optional[int] = field(None, range=STEPS)
    """Samples of the final decay phase of WSD (sample-based training; unset: the whole decay,
    lr_decay_samples, which validate() fills in)."""

    lr_warmup_fraction: Optional[float] = field(None, range=PROBABILITY)
    """Warmup length as a fraction of the decay length; excludes lr_warmup_iters/samples. The
    warmup is that fraction of the decay's samples, not rounded (as in Megatron-LM)."""

    lr_warmup_iters: int = field(0, range=STEPS)
    """Iterations of linear LR warmup."""

    lr_warmup_samples: int = field(0, range=STEPS)
    """Samples of linear LR warmup (sample-based training)."""

    lr_warmup_init: float = field(0.0, range=LEARNING_RATE)
    """LR at the start of warmup."""

    max_steps: Optional[int] = field(None, range=STEPS)
    """Length of the schedule in iterations when it should differ from train_iters, e.g. a job that
    runs the first part of a longer planned run. Defaults to train_iters. A set lr_decay_iters
    still sets the decay (NVIDIA Megatron Bridge replaces it with max_steps)."""

    override_opt_param_scheduler: bool = False
    """On resume, use this config's schedule instead of the one in the checkpoint."""

    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, use the schedule stored in the checkpoint."""

    start_weight_decay: Optional[float] = field(None, range=WEIGHT_DECAY)
    """Weight decay at the start (default: optimizer.weight_decay)."""

    end_weight_decay: Optional[float] = field(None, range=WEIGHT_DECAY)
    """Weight decay at the end (default: optimizer.weight_decay)."""

    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How weight decay moves from start_weight_decay to end_weight_decay."""

    lr_decay_steps: Optional[int] = field(init=False, default=None, range=STEPS)
    """Derived: decay length in samples."""

    lr_warmup_steps: Optional[float] = field(init=False, default=None, range=STEPS)
    """Derived: warmup length in samples (a fraction of one when lr_warmup_fraction gives it)."""

    wd_incr_steps: Optional[int] = field(init=False, default=None, range=STEPS)
    """Derived: weight-decay ramp length in samples."""

    wsd_decay_steps: Optional[int] = field(init=False, default=None, range=STEPS)
    """Derived: WSD final-decay length in samples."""

    def _finalize(self, problems: Problems) -> None:
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            problems.add(
                "override_opt_param_scheduler",
                "override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are both set",
                "set at most one of them",
            )
        iteration_set = [n for n in ITERATION_FIELDS if getattr(self, n)]
        sample_set = [n for n in SAMPLE_FIELDS if getattr(self, n)]
        if iteration_set and sample_set:
            problems.add(
                sample_set[0],
                f"iteration-based fields {iteration_set} are mixed with sample-based fields {sample_set}",
                "give schedule lengths either all in iterations or all in samples",
            )
        # lr_warmup_fraction is in [0, 1] by its declared range
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            problems.add(
                "lr_warmup_fraction",
                "lr_warmup_fraction is set together with lr_warmup_iters/lr_warmup_samples",
                "set only one way of giving the warmup length",
            )
        if self.lr_decay_style != "WSD":
            for name, default in (("lr_wsd_decay_style", "exponential"), ("lr_wsd_decay_iters", None), ("lr_wsd_decay_samples", None)):
                problems.check(
                    getattr(self, name) == default,
                    name,
                    f"{getattr(self, name)!r} has no effect: lr_decay_style is {self.lr_decay_style!r}, not 'WSD'",
                    f"set scheduler.lr_decay_style=WSD, or remove scheduler.{name}",
                )
