"""Run a job end to end: setup, train, final evaluation, and a teardown that never hangs."""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

import torch

from megatron_bridge.runtime import cpu_backend
from megatron_bridge.runtime.callbacks import Callback
from megatron_bridge.training.config import ConfigContainer
from megatron_bridge.runtime.distributed import abort, teardown
from megatron_bridge.training.state import GlobalState
from megatron_bridge.training.train import Run, Stop, run_evaluation, train
from megatron_bridge.training.checkpointing import lock
from megatron_bridge.training.comm_overlap import destroy_tp_communicators
from megatron_bridge.training.resiliency.inprocess import run_with_inprocess_restart
from megatron_bridge.training.setup import setup
from megatron_bridge.training.signals import exit_requested

logger = logging.getLogger("megatron_bridge")


def run_job(config: ConfigContainer, forward_step_func: Callable, callbacks: Optional[Iterable[Callback]] = None) -> GlobalState:
    """`execute`, wrapped for in-process restart when `config.inprocess_restart.enabled`."""
    if config.inprocess_restart is not None and config.inprocess_restart.enabled:
        return run_with_inprocess_restart(execute, config, forward_step_func, callbacks)
    return execute(config, forward_step_func, callbacks)


def execute(
    config: ConfigContainer,
    forward_step_func: Callable,
    callbacks: Optional[Iterable[Callback]] = None,
    store: Optional[torch.distributed.Store] = None,
) -> GlobalState:
    """Set up, train, evaluate on the validation and test sets, shut down; return the final state.

    If this call created the process group it destroys it. If anything raises, the process groups
    are aborted (so the other ranks fail fast instead of waiting) and the error propagates.
    """
    state = GlobalState(cfg=config)
    run: Optional[Run] = None
    try:
        run = setup(config, forward_step_func, callbacks, state=state, store=store)
        _train_and_evaluate(run)
    except BaseException as exc:
        if state.progress is not None:
            state.progress.failed(exc)
        _close_tracker(state, failed=True)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            abort()
        _shutdown(state)
        raise
    _close_tracker(state, failed=False)
    _shutdown(state)
    if state.exit_code:
        raise RerunExit(state.exit_code)
    return state


class RerunExit(SystemExit):
    """megatron-core's rerun state machine asks for the job to be restarted (after validating a
    suspicious result); `code` is its exit status (16: resume to re-run elsewhere, 17: failed
    validation). Uncaught, it ends the process with that status and no traceback."""


def _train_and_evaluate(run: Run) -> None:
    state, v = run.state, run.state.cfg.validation
    ts, total = state.train_state, state.cfg.train.train_iters
    if not ts.do_train:
        stop = Stop("validation.skip_train is set" if v.skip_train else "no training data", True)
    elif ts.step >= total:
        stop = Stop(f"already at train.train_iters={total}", True)
    elif exit_requested(state.signal_handler, state.device):  # arrived while the run was set up
        stop = Stop("exit signal received before the first iteration", False, save=False)
    else:
        stop = train(run)
    if state.is_logging_rank:
        logger.info("training stopped at iteration %d: %s", ts.step, stop.reason)
    if state.progress is not None:
        state.progress.finished(stop.reason)
    if stop.completed:
        if ts.do_valid and v.eval_iters:
            run_evaluation(run, run.valid_iterator, v.eval_iters, "validation")
        if ts.do_test:
            test_iters = v.test_iters if v.test_iters is not None else v.eval_iters
            run_evaluation(run, run.test_iterator, test_iters, "test")
    if run.checkpointer is not None:
        run.checkpointer.finalize(run, save=stop.save)


def _close_tracker(state: GlobalState, failed: bool) -> None:
    if state.tracker is None:
        return
    try:
        state.tracker.close(failed=failed)
    except Exception as exc:  # noqa: BLE001 - a tracker must not hide the training outcome
        logger.warning("closing experiment trackers failed: %s", exc)
    state.tracker = None


def _shutdown(state: GlobalState) -> None:
    state.model = state.optimizer = state.scheduler = None  # free memory; counters stay
    if state.signal_handler is not None:
        state.signal_handler.restore()
    for helper in (state.fault_tolerance, state.stragglers):
        if helper is not None:
            try:
                helper.close()
            except Exception as exc:  # noqa: BLE001 - must not hide the training outcome
                logger.warning("closing %s failed: %s", type(helper).__name__, exc)
    state.fault_tolerance = state.stragglers = None
    if state.save_lock is not None:
        lock.release(state.save_lock)
        state.save_lock = None
    if state.tp_communicators:
        destroy_tp_communicators()
        state.tp_communicators = False
    try:
        teardown(destroy_group=state.created_process_group)
    finally:
        if state.cpu_backend_activated:
            cpu_backend.deactivate()
            state.cpu_backend_activated = False
        if state.deterministic_before is not None:
            enabled, warn_only = state.deterministic_before
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
            state.deterministic_before = None
