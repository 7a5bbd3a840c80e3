"""How long and with what batches to train, and when to evaluate."""

from __future__ import annotations

import signal
from typing import Literal, Optional

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import INTERVAL, SIZE, STEPS, Unsupported, field
from megatron_bridge.training.config.run_rules import sample_based_train_iters


PREEMPTION_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU")
    if hasattr(signal, name)
)
"""Signals `train.exit_signal` may be: those schedulers and users send to stop a job (SIGTERM
from Slurm, PBS and Kubernetes, SIGUSR1/SIGUSR2 as advance notice with Slurm's --signal, LSF
and SGE, SIGXCPU at a CPU-time limit, SIGHUP when the session ends, SIGINT from Ctrl-C). Others
also arrive in normal operation (SIGCHLD whenever a helper process exits, SIGALRM, SIGWINCH,
...) and would stop a healthy run; SIGKILL and SIGSTOP cannot be caught."""


@config_dataclass(kw_only=True)
class TrainingConfig(ConfigBase):
    """Settings of the training loop: length, batch sizes, exit conditions, garbage collection."""

    micro_batch_size: Optional[int] = field(None, range=SIZE)
    """Samples per forward/backward pass on one model replica."""

    global_batch_size: Optional[int] = field(None, range=SIZE)
    """Samples per optimizer step across all data-parallel replicas; a multiple of
    micro_batch_size x data-parallel size (the quotient is the number of microbatches)."""

    rampup_batch_size: Optional[list[int]] = field(None, range=SIZE)
    """Batch size ramp-up as [start_batch_size, batch_size_increment, ramp_up_samples]. With
    train_iters, schedule lengths in iterations are sized in the samples those iterations consume."""

    decrease_batch_size_if_needed: bool = field(
        False,
        status=Unsupported(
            "the global batch size is used as given: sample counters, the learning-rate schedule and the samplers "
            "count train.global_batch_size, so a batch that megatron-core rounded down would be counted wrongly; make "
            "global_batch_size a multiple of micro_batch_size x data-parallel size"
        ),
    )
    """Lower the global batch size when the data-parallel size changes (e.g. after a failure)."""

    empty_unused_memory_level: Literal[0, 1, 2] = field(
        0,
        status=Unsupported('not implemented: the CUDA cache is never emptied by the loop'),
    )
    """Call torch.cuda.empty_cache() each iteration: 0 never, 1 after the step, 2 also after eval."""

    check_weight_hash_across_dp_replicas_interval: Optional[int] = field(
        None,
        range=STEPS,
        status=Unsupported('not implemented'),
    )
    """Check every N iterations that weights are identical across data-parallel replicas."""

    train_sync_interval: Optional[int] = field(None, range=INTERVAL, status=Unsupported('not implemented'))
    """Synchronize the CPU with the GPU every N iterations to bound launch-ahead."""

    train_iters: Optional[int] = field(None, range=INTERVAL)
    """Number of optimizer steps to train for. Exactly one of train_iters / train_samples."""

    train_samples: Optional[int] = field(None, range=INTERVAL)
    """Number of samples to train for; train_iters is derived as train_samples / global_batch_size."""

    exit_interval: Optional[int] = field(None, range=INTERVAL)
    """Save (if a save directory is set) and exit when the iteration is a multiple of this
    (None: never)."""

    exit_duration_in_mins: Optional[float] = field(None, range="(0, 5256000]")
    """Save and exit after this many minutes of training."""

    exit_signal_handler: bool = False
    """On `exit_signal`, save a checkpoint and exit cleanly at the next iteration boundary (an
    evaluation under way stops at its next batch; a signal during setup stops the run before it
    trains, with nothing to save)."""

    exit_signal: signal.Signals = signal.SIGTERM
    """The signal that triggers a save-and-exit when exit_signal_handler is on: SIGTERM, SIGINT,
    SIGHUP, SIGUSR1, SIGUSR2 or SIGXCPU (signals that ask a job to stop)."""

    exit_signal_handler_for_dataloader: bool = field(False, status=Unsupported('not implemented'))
    """Also install the exit signal handler in dataloader worker processes."""

    manual_gc: bool = False
    """Disable automatic garbage collection and collect every `manual_gc_interval` iterations, so
    all ranks pause together instead of at random times."""

    manual_gc_interval: int = field(0, range=STEPS)
    """Iterations between garbage collections under manual_gc (0: only before evaluations, see
    manual_gc_eval); without manual_gc it is refused, as it would do nothing."""

    manual_gc_eval: bool = True
    """With manual_gc, also collect garbage before each evaluation."""

    iterations_to_skip: list[int] = field(default_factory=list, range=STEPS)
    """Iterations whose batch is consumed but whose optimizer step is skipped."""

    check_optimizer_step_success: bool = field(
        True,
        status=Unsupported('not implemented: a failed step is reported by the skipped-iterations count'),
    )
    """Checks optimizer.step() succeeded at each training step."""

    skip_sync_grad_norm_across_mp: bool = field(False, status=Unsupported('not implemented'))
    """Skips syncing the grad norm across the model parallel group."""

    eval_iters: Optional[int] = field(None, range=STEPS)
    """Deprecated: use validation.eval_iters."""

    eval_interval: Optional[int] = field(None, range=INTERVAL)
    """Deprecated: use validation.eval_interval."""

    skip_train: Optional[bool] = None
    """Deprecated: use validation.skip_train."""

    def _finalize(self, problems: Problems) -> None:
        # Numbers out of their range (declared ranges: sizes >= 1, intervals >= 1, ...) never get here.
        mbs, gbs, rampup = self.micro_batch_size, self.global_batch_size, self.rampup_batch_size
        problems.check(mbs is not None, "micro_batch_size", "is not set", "set train.micro_batch_size")
        problems.check(gbs is not None, "global_batch_size", "is not set", "set train.global_batch_size")
        rampup_ok = rampup is None or problems.check(
            len(rampup) == 3 and all(v > 0 for v in rampup),
            "rampup_batch_size",
            f"must be three positive ints [start, increment, samples], got {rampup}",
            "e.g. [32, 32, 1000000]",
        )
        if rampup is not None and rampup_ok and gbs is not None:
            # megatron-core ramps start, start + increment, ... up to exactly global_batch_size, and
            # needs at least one step (its samples per step divide by the number of steps)
            start, increment, _ = rampup
            rampup_ok = problems.check(
                start < gbs and (gbs - start) % increment == 0,
                "rampup_batch_size",
                f"a ramp from {start} in steps of {increment} does not end at global_batch_size={gbs}",
                f"choose a start below {gbs} that differs from it by a multiple of the increment",
            )
        if self.train_iters is not None and self.train_samples is not None:
            problems.add(
                "train_iters",
                f"train_iters ({self.train_iters}) and train_samples ({self.train_samples}) are both set",
                "set exactly one of train.train_iters / train.train_samples",
            )
        elif self.train_iters is None and self.train_samples is None:
            problems.add("train_iters", "neither train_iters nor train_samples is set", "set train.train_iters")
        elif self.train_iters is None and gbs is not None and rampup_ok:
            iters = sample_based_train_iters(self.train_samples, gbs, rampup)
            if problems.check(
                iters > 0,
                "train_samples",
                f"{self.train_samples} samples make no whole global batch of {gbs}",
                f"use at least {gbs} samples",
            ):
                self._derive("train_iters", iters)
        for name, default in (("manual_gc_interval", 0), ("manual_gc_eval", True)):
            problems.check(
                self.manual_gc or getattr(self, name) == default,
                name,
                f"{getattr(self, name)} has no effect without train.manual_gc (Python's automatic garbage collection stays on)",
                f"set train.manual_gc=true to collect garbage on this schedule, or remove train.{name}",
            )
        problems.check(
            self.exit_signal_handler or self.exit_signal == signal.SIGTERM,
            "exit_signal",
            f"{getattr(self.exit_signal, 'name', self.exit_signal)} has no effect without train.exit_signal_handler "
            "(no handler is installed: the signal ends the run without a checkpoint)",
            "set train.exit_signal_handler=true, or remove train.exit_signal",
        )
        sig = self.exit_signal
        problems.check(
            sig in PREEMPTION_SIGNALS,
            "exit_signal",
            f"{sig.name if isinstance(sig, signal.Signals) else repr(sig)} "
            + ("cannot be caught, so no checkpoint could be saved on it"
               if sig in (signal.SIGKILL, signal.SIGSTOP)
               else "is not a stop request: processes also get it in normal operation, which would stop a healthy run"),
            f"use one of {', '.join(s.name for s in PREEMPTION_SIGNALS)}",
        )


@config_dataclass(kw_only=True)
class ValidationConfig(ConfigBase):
    """When and how much to evaluate on the validation set."""

    eval_interval: Optional[int] = field(1000, range=INTERVAL)
    """Evaluate every N iterations (None: only at the end of training)."""

    eval_iters: Optional[int] = field(100, range=STEPS)
    """Batches per evaluation (0: no evaluation)."""

    eval_global_batch_size: Optional[int] = field(None, range=SIZE)
    """Global batch size for evaluation; defaults to train.global_batch_size."""

    eval_micro_batch_size: Optional[int] = field(None, range=SIZE)
    """Micro batch size for evaluation; defaults to train.micro_batch_size."""

    skip_train: bool = False
    """Skip training: only evaluate (validation and test) and exit."""

    test_iters: Optional[int] = field(None, range=STEPS)
    """Batches for the final test evaluation; defaults to eval_iters."""
