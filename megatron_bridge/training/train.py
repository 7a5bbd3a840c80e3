"""The train loop: steps, periodic logging and evaluation, checkpoints, exit conditions."""

from __future__ import annotations

import gc
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from megatron_bridge.models.param_count import flops_per_token
from megatron_bridge.runtime.callbacks import CallbackList
from megatron_bridge.training import console, profiling
from megatron_bridge.training.evaluate import evaluate
from megatron_bridge.training.gpt_step import check_step_losses, defer_loss_checks
from megatron_bridge.training.loss_reduction import LossAccumulator
from megatron_bridge.training.metrics import (
    EnergyMeter,
    eval_metrics,
    moe_losses,
    mtp_losses,
    processed_work,
    reduced_metrics,
    reset_loss_trackers,
    timer_values,
    train_metrics,
)
from megatron_bridge.training.state import GlobalState

if TYPE_CHECKING:
    from megatron_bridge.training.checkpointing import Checkpointer

logger = logging.getLogger("megatron_bridge")


@dataclass
class Run:
    """Everything the loop works with, as built by `setup()`. The model, optimizer and scheduler
    belong to `state` (forward steps and callbacks see them there)."""

    state: GlobalState
    forward_step: Callable
    train_iterator: Any = None
    valid_iterator: Any = None
    test_iterator: Any = None
    callbacks: CallbackList = field(default_factory=CallbackList)
    checkpointer: Optional["Checkpointer"] = None
    """Saves checkpoints (`save(run, reason)`); None when checkpoint.save is not set."""
    energy_meter: Optional[EnergyMeter] = None
    """Reads GPU energy counters (`logger.log_energy`)."""


@dataclass
class _Interval:
    """Statistics gathered between two log steps."""

    steps: int = 0
    seconds: float = 0.0
    skipped: int = 0
    nan: int = 0
    grad_norm: float = float("nan")
    losses: LossAccumulator = field(default_factory=LossAccumulator)
    lengths: Counter = field(default_factory=Counter)


@dataclass
class StepResult:
    """What one training step produced."""

    reports: list = field(default_factory=list)
    lengths: Counter = field(default_factory=Counter)
    """{sequence length: sequences} of the micro batches this rank trained on (`GlobalState.batch_lengths`)."""

    grad_norm: float = float("nan")
    update_ok: bool = False
    rerun_checkpoint: bool = False
    """megatron-core's rerun state machine asks for a checkpoint before this step's update."""

    rerun_exit_code: Optional[int] = None
    """Set when the rerun state machine asks the job to stop with this status."""


@dataclass(frozen=True)
class Stop:
    """Why the train loop ended."""

    reason: str
    completed: bool
    """True when training reached `train.train_iters` (the final evaluation follows)."""
    save: bool = True
    """False when the state is the one the run started from (nothing to save)."""


def train_step(run: Run, fwd_bwd: Callable) -> StepResult:
    """One optimizer step over `get_num_microbatches()` micro batches, driven by megatron-core's
    rerun state machine (which may repeat the forward/backward to validate a result)."""
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size, get_num_microbatches
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    cfg, timers = run.state.cfg, run.state.timers
    rerun = get_rerun_state_machine()
    seq = cfg.model.seq_length
    result = StepResult()
    while rerun.should_run_forward_backward(run.train_iterator):
        for chunk in run.state.model:
            chunk.zero_grad_buffer()
        run.state.optimizer.zero_grad()
        defer_loss_checks(run.state)
        run.state.batch_lengths = Counter()  # a repeated pass counts once
        # megatron-core's schedule times itself as "forward-backward" (model config `timers`)
        result.reports = fwd_bwd(
            forward_step_func=run.forward_step,
            data_iterator=run.train_iterator,
            model=run.state.model,
            num_microbatches=get_num_microbatches(),
            seq_length=seq,
            micro_batch_size=cfg.train.micro_batch_size,
            decoder_seq_length=seq,
            forward_only=False,
        )
        check_step_losses(run.state)
    result.lengths, run.state.batch_lengths = run.state.batch_lengths or Counter(), None
    checkpoint, should_exit, exit_code = rerun.should_checkpoint_and_exit()
    result.rerun_checkpoint = checkpoint
    if should_exit:
        result.rerun_exit_code = exit_code
        return result
    timers("optimizer", log_level=1).start(barrier=False)
    update_ok, grad_norm, _ = run.state.optimizer.step()
    timers("optimizer").stop()
    if update_ok:
        run.state.scheduler.step(increment=get_current_global_batch_size())
    result.update_ok = bool(update_ok)
    result.grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    return result


def skip_batch(run: Run) -> None:
    """Consume one step's data without training on it (`train.iterations_to_skip`)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    iterators = run.train_iterator if isinstance(run.train_iterator, list) else [run.train_iterator]
    for _ in range(get_num_microbatches()):
        for it in iterators:
            next(it)


def train(run: Run) -> Stop:
    """Train until `train.train_iters` or an exit condition."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    state, t = run.state, run.state.cfg.train
    # The machine counts steps itself and names them in its reports: align it with ours (1-based).
    get_rerun_state_machine().current_iteration = state.train_state.step
    for chunk in run.state.model:
        chunk.train()
    reset_loss_trackers()
    run.callbacks.on_train_start(state)
    profiler = profiling.StepProfiler.for_run(state)
    if t.manual_gc:
        gc.disable()
        gc.collect()
    try:
        stop = _loop(run, profiler)
    finally:
        profiler.close()
        if t.manual_gc:
            gc.enable()
    run.callbacks.on_train_end(state)
    return stop


def _loop(run: Run, profiler: Any) -> Stop:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size, update_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    state, cfg = run.state, run.state.cfg
    ts, t, v = state.train_state, cfg.train, cfg.validation
    fwd_bwd = get_forward_backward_func()
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    interval = _Interval()
    loop_start, start_step = time.perf_counter(), ts.step
    flops_per_sample = flops_per_token(cfg.model) * cfg.model.seq_length
    if cfg.logger.log_energy:
        run.energy_meter = EnergyMeter(state.device)
    # A resumed run continues a batch-size ramp-up at the samples its checkpoint had consumed.
    update_num_microbatches(ts.consumed_train_samples, consistency_check=True)
    while ts.step < t.train_iters:
        run.callbacks.on_step_start(state)
        profiler.step_start(ts.step)
        started = time.perf_counter()
        gbs = get_current_global_batch_size()
        if ts.step + 1 in t.iterations_to_skip:
            skip_batch(run)
            get_rerun_state_machine().current_iteration += 1
            step = StepResult()
        else:
            step = train_step(run, fwd_bwd)
        if step.rerun_checkpoint and run.checkpointer is not None:
            # the state before this step's update, with the data to re-run it on
            run.checkpointer.save(run, "rerun state machine", rerun_requested=True)
        if step.rerun_exit_code is not None:
            state.exit_code = step.rerun_exit_code
            return Stop(f"the rerun state machine asks to restart the job (exit code {step.rerun_exit_code})", False)
        ts.step += 1
        profiler.step_end(ts.step)
        ts.consumed_train_samples += gbs
        ts.floating_point_operations_so_far += flops_per_sample * gbs
        if not step.update_ok:
            ts.skipped_train_samples += gbs
        update_num_microbatches(ts.consumed_train_samples, consistency_check=True)
        elapsed = time.perf_counter() - started
        interval.steps += 1
        interval.seconds += elapsed
        interval.skipped += 0 if step.update_ok else 1
        interval.nan += 0 if math.isfinite(step.grad_norm) or not step.update_ok else 1
        interval.grad_norm = step.grad_norm
        interval.lengths.update(step.lengths)
        if last_stage:
            interval.losses.add(step.reports)
        if run.checkpointer is not None:
            run.checkpointer.poll()
        if run.callbacks.callbacks:
            run.callbacks.on_step_end(state, _step_metrics(run, step, elapsed))

        if ts.step % cfg.logger.log_interval == 0 or ts.step == t.train_iters:
            _log_step(run, interval, dp_group, loop_start, start_step)
            interval = _Interval()
        if t.manual_gc and t.manual_gc_interval and ts.step % t.manual_gc_interval == 0:
            gc.collect()
        if v.eval_interval and v.eval_iters and run.valid_iterator is not None and ts.step % v.eval_interval == 0 and ts.step < t.train_iters:
            run_evaluation(run, run.valid_iterator, v.eval_iters, "validation")
        reason = _exit_reason(run)
        if run.checkpointer is not None and (reason or run.checkpointer.due(ts.step)):
            run.checkpointer.save(run, reason or "interval")
        if reason:
            return Stop(reason, False)
    return Stop("completed", True)


def _step_metrics(run: Run, step: StepResult, elapsed: float) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        "learning_rate": run.state.optimizer.param_groups[0]["lr"],
        "grad_norm": step.grad_norm,
        "skipped": not step.update_ok,
        "iteration_time": elapsed,
    }
    if step.reports:
        local = LossAccumulator()
        local.add(step.reports)
        metrics.update(local.average(None))
    return metrics


def _log_step(run: Run, interval: _Interval, dp_group: Any, loop_start: float, start_step: int) -> None:
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size, get_num_microbatches

    state, cfg = run.state, run.state.cfg
    ts = state.train_state
    losses = interval.losses.average(dp_group) if interval.losses.totals else {}
    if cfg.model.mtp_num_layers:  # collective
        losses.update(mtp_losses(get_num_microbatches() * interval.steps, dp_group))
    if cfg.model.num_moe_experts:  # collective
        losses.update(moe_losses(cfg.model, get_num_microbatches() * interval.steps, state.device))
    # collective: every rank, before the rank check
    timers = timer_values(state, interval.steps)
    reduced = reduced_metrics(state, run.state.model, run.energy_meter)
    work = processed_work(cfg.model, interval.lengths, state.device)  # collective
    if not state.is_logging_rank or cfg.logger.skip_train_metrics_log:
        return
    values = train_metrics(state, run.state.optimizer, interval, losses, timers, get_current_global_batch_size(), work)
    values.update(reduced)
    done, remaining = ts.step - start_step, cfg.train.train_iters - ts.step
    eta = (time.perf_counter() - loop_start) / done * remaining if done else float("nan")
    phase = state.data_phases.label(ts.step - 1) if state.data_phases is not None else None
    logger.info(console.train_line(ts.step, cfg.train.train_iters, values, eta, phase=phase))
    if timers:
        logger.info(console.timers_line(timers))
    state.tracker.log_metrics(values, ts.step)


def run_evaluation(run: Run, iterator: Any, num_iters: int, split: str) -> Optional[dict[str, float]]:
    state = run.state
    run.callbacks.on_eval_start(state)
    if state.cfg.train.manual_gc and state.cfg.train.manual_gc_eval:
        gc.collect()
    losses = evaluate(state, run.forward_step, iterator, run.state.model, num_iters)
    if losses is not None and state.is_logging_rank:
        logger.info(console.eval_line(state.train_state.step, split, losses))
        with_ppl = state.cfg.logger.log_validation_ppl_to_tensorboard
        state.tracker.log_metrics(eval_metrics(losses, split, with_ppl), state.train_state.step)
    run.callbacks.on_eval_end(state, losses or {})
    return losses


def _exit_reason(run: Run) -> str:
    """Why training should stop now ('' if it should go on); every rank agrees."""
    state, t = run.state, run.state.cfg.train
    step = state.train_state.step
    if t.exit_interval and step % t.exit_interval == 0:
        return f"exit_interval={t.exit_interval} reached"
    flags = []
    if state.signal_handler is not None:
        flags.append(("signal", state.signal_handler.received()))
    if t.exit_duration_in_mins:
        flags.append(("duration", (time.time() - state.start_time) / 60.0 > t.exit_duration_in_mins))
    if not flags:
        return ""
    votes = torch.tensor([int(flag) for _, flag in flags], dtype=torch.int32, device=state.device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MAX)
    for (name, _), vote in zip(flags, votes.tolist()):
        if vote:
            return "exit signal received" if name == "signal" else f"exit_duration_in_mins={t.exit_duration_in_mins} reached"
    return ""
