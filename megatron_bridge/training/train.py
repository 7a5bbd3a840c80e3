"""The train loop: steps, periodic logging and evaluation, checkpoints, exit conditions."""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron_bridge.training import console
from megatron_bridge.training.callbacks import CallbackList
from megatron_bridge.training.evaluate import evaluate, with_perplexity
from megatron_bridge.training.loss_reduction import LossAccumulator
from megatron_bridge.training.state import GlobalState

logger = logging.getLogger("megatron_bridge")


@dataclass
class Run:
    """Everything the loop works with, as built by `setup()`."""

    state: GlobalState
    model: list[Any]
    optimizer: Any
    scheduler: Any
    forward_step: Callable
    train_iterator: Any = None
    valid_iterator: Any = None
    test_iterator: Any = None
    callbacks: CallbackList = field(default_factory=CallbackList)
    checkpointer: Any = None
    """Saves checkpoints (`save(run, reason)`); None when checkpoint.save is not set."""


@dataclass
class _Interval:
    """Statistics gathered between two log steps."""

    steps: int = 0
    seconds: float = 0.0
    skipped: int = 0
    nan: int = 0
    grad_norm: float = float("nan")
    losses: LossAccumulator = field(default_factory=LossAccumulator)


def train_step(run: Run, fwd_bwd: Callable) -> tuple[list, float, bool, bool]:
    """One optimizer step over `get_num_microbatches()` micro batches.

    Returns (loss reports, grad norm, update succeeded, the rerun machine asks to exit).
    """
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size, get_num_microbatches
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    cfg, timers = run.state.cfg, run.state.timers
    rerun = get_rerun_state_machine()
    seq = cfg.model.seq_length
    reports: list = []
    while rerun.should_run_forward_backward(run.train_iterator):
        for chunk in run.model:
            chunk.zero_grad_buffer()
        run.optimizer.zero_grad()
        timers("forward-backward", log_level=1).start(barrier=False)
        reports = fwd_bwd(
            forward_step_func=run.forward_step,
            data_iterator=run.train_iterator,
            model=run.model,
            num_microbatches=get_num_microbatches(),
            seq_length=seq,
            micro_batch_size=cfg.train.micro_batch_size,
            decoder_seq_length=seq,
            forward_only=False,
        )
        timers("forward-backward").stop()
    _, should_exit, _ = rerun.should_checkpoint_and_exit()
    if should_exit:
        return reports, float("nan"), False, True
    timers("optimizer", log_level=1).start(barrier=False)
    update_ok, grad_norm, _ = run.optimizer.step()
    timers("optimizer").stop()
    if update_ok:
        run.scheduler.step(increment=get_current_global_batch_size())
    return reports, float(grad_norm) if grad_norm is not None else float("nan"), bool(update_ok), False


def skip_batch(run: Run) -> None:
    """Consume one step's data without training on it (`train.iterations_to_skip`)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    iterators = run.train_iterator if isinstance(run.train_iterator, list) else [run.train_iterator]
    for _ in range(get_num_microbatches()):
        for it in iterators:
            next(it)


def train(run: Run) -> str:
    """Train until `train.train_iters` or an exit condition; returns why the loop stopped."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size, update_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    state, cfg = run.state, run.state.cfg
    ts, t, v = state.train_state, cfg.train, cfg.validation
    fwd_bwd = get_forward_backward_func()
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    interval = _Interval()
    loop_start = time.perf_counter()
    start_step = ts.step
    if t.manual_gc:
        gc.disable()
        gc.collect()
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    # The machine counts steps itself and names them in its reports: align it with ours (1-based).
    rerun = get_rerun_state_machine()
    rerun.current_iteration = ts.step
    for chunk in run.model:
        chunk.train()
    run.callbacks.on_train_start(state)
    reason = "completed"
    while ts.step < t.train_iters:
        run.callbacks.on_step_start(state)
        started = time.perf_counter()
        gbs = get_current_global_batch_size()
        if ts.step + 1 in t.iterations_to_skip:
            skip_batch(run)
            rerun.current_iteration += 1
            reports, grad_norm, update_ok, rerun_exit = [], float("nan"), False, False
        else:
            reports, grad_norm, update_ok, rerun_exit = train_step(run, fwd_bwd)
        if rerun_exit:
            reason = "rerun state machine asked to exit"
            break
        ts.step += 1
        ts.consumed_train_samples += gbs
        if not update_ok:
            ts.skipped_train_samples += gbs
        update_num_microbatches(ts.consumed_train_samples, consistency_check=True)
        elapsed = time.perf_counter() - started
        interval.steps += 1
        interval.seconds += elapsed
        interval.skipped += 0 if update_ok else 1
        interval.nan += 0 if math.isfinite(grad_norm) or not update_ok else 1
        interval.grad_norm = grad_norm
        if last_stage:
            interval.losses.add(reports)
        if run.checkpointer is not None:
            run.checkpointer.poll()
        if run.callbacks.callbacks:
            run.callbacks.on_step_end(state, _step_metrics(run, reports, grad_norm, update_ok, elapsed))

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
            break
    else:
        reason = "completed"
    reason = reason or "completed"
    if t.manual_gc:
        gc.enable()
    run.callbacks.on_train_end(state)
    return reason


def _step_metrics(run: Run, reports: list, grad_norm: float, update_ok: bool, elapsed: float) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        "learning_rate": run.optimizer.param_groups[0]["lr"],
        "grad_norm": grad_norm,
        "skipped": not update_ok,
        "iteration_time": elapsed,
    }
    if reports:
        local = LossAccumulator()
        local.add(reports)
        metrics.update(local.average(None))
    return metrics


def _log_step(run: Run, interval: _Interval, dp_group: Any, loop_start: float, start_step: int) -> None:
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size

    state, cfg = run.state, run.state.cfg
    ts = state.train_state
    losses = interval.losses.average(dp_group) if interval.losses.totals else {}
    if not state.is_logging_rank or cfg.logger.skip_train_metrics_log:
        return
    step_time = interval.seconds / max(1, interval.steps)
    gbs = get_current_global_batch_size()
    metrics = {
        **losses,
        "learning-rate": run.optimizer.param_groups[0]["lr"],
        "iteration-time": step_time,
        "tokens-per-second": gbs * cfg.model.seq_length / step_time if step_time > 0 else 0.0,
        "batch-size": float(gbs),
        "consumed-samples": float(ts.consumed_train_samples),
        "skipped-iterations": float(interval.skipped),
        "nan-iterations": float(interval.nan),
    }
    if math.isfinite(interval.grad_norm):
        metrics["grad-norm"] = interval.grad_norm
    if cfg.logger.log_loss_scale_to_tensorboard:
        metrics["loss-scale"] = float(run.optimizer.get_loss_scale())
    done = ts.step - start_step
    remaining = cfg.train.train_iters - ts.step
    eta = (time.perf_counter() - loop_start) / done * remaining if done else float("nan")
    logger.info(console.train_line(ts.step, cfg.train.train_iters, metrics, eta))
    state.tracker.log_metrics(metrics, ts.step)
    if cfg.logger.timing_log_level >= 1 and state.timers is not None:
        state.timers.log(["forward-backward", "optimizer", "batch-generator"], rank=state.logging_rank, normalizer=max(1, interval.steps))


def run_evaluation(run: Run, iterator: Any, num_iters: int, split: str) -> Optional[dict[str, float]]:
    state = run.state
    run.callbacks.on_eval_start(state)
    if state.cfg.train.manual_gc and state.cfg.train.manual_gc_eval:
        gc.collect()
    metrics = evaluate(state, run.forward_step, iterator, run.model, num_iters)
    if metrics is not None and state.is_logging_rank:
        logger.info(console.eval_line(state.train_state.step, split, metrics))
        state.tracker.log_metrics(with_perplexity(metrics, split), state.train_state.step)
    run.callbacks.on_eval_end(state, metrics or {})
    return metrics


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
