"""Forward-only evaluation over a number of global batches."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from megatron_bridge.training.gpt_step import check_step_losses, defer_loss_checks
from megatron_bridge.training.loss_reduction import LossAccumulator
from megatron_bridge.training.signals import exit_requested
from megatron_bridge.training.state import GlobalState

logger = logging.getLogger("megatron_bridge")


def evaluate(
    state: GlobalState,
    forward_step: Callable,
    data_iterator: Any,
    model: list[Any],
    num_iters: int,
) -> Optional[dict[str, float]]:
    """Average losses over `num_iters` evaluation batches; None on ranks that hold no loss
    (not the last pipeline stage), and on every rank when the exit signal stopped it early."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    cfg = state.cfg
    v = cfg.validation
    dp = parallel_state.get_data_parallel_world_size()
    num_micro = v.eval_global_batch_size // (v.eval_micro_batch_size * dp)
    seq = cfg.model.seq_length
    fwd_bwd = get_forward_backward_func()
    rerun = get_rerun_state_machine()
    mode = rerun.get_mode()
    rerun.set_mode(RerunMode.DISABLED)  # results are not re-validated during evaluation
    for chunk in model:
        chunk.eval()
    totals = LossAccumulator()
    stopped = False
    try:
        with torch.no_grad():
            for done in range(num_iters):
                if exit_requested(state.signal_handler, state.device):
                    stopped = True
                    if state.is_logging_rank:
                        logger.info("evaluation stopped after %d of %d batches: exit signal received", done, num_iters)
                    break
                defer_loss_checks(state)
                reports = fwd_bwd(
                    forward_step_func=forward_step,
                    data_iterator=data_iterator,
                    model=model,
                    num_microbatches=num_micro,
                    seq_length=seq,
                    micro_batch_size=v.eval_micro_batch_size,
                    decoder_seq_length=seq,
                    forward_only=True,
                )
                check_step_losses(state)
                if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                    totals.add(reports)
                state.train_state.consumed_valid_samples += v.eval_global_batch_size
    finally:
        for chunk in model:
            chunk.train()
        rerun.set_mode(mode)
    if stopped or not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return totals.average(parallel_state.get_data_parallel_group(with_context_parallel=True))

