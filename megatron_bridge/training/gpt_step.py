"""The standard GPT forward step: next-token loss over the tokens the loss mask keeps."""

from __future__ import annotations

import os
from functools import partial
from typing import Iterator, Optional

import torch

from megatron_bridge.training.state import GlobalState

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "cu_seqlens")
"""What the step takes from a batch; `cu_seqlens` (packed sequences for TransformerEngine) is optional."""


def get_batch(data_iterator: Iterator[dict], state: GlobalState) -> dict[str, Optional[torch.Tensor]]:
    """Next micro batch, on this rank's device, sliced for context parallelism."""
    batch = next(data_iterator)
    device = "cuda" if state.device == "cuda" else None
    out: dict[str, Optional[torch.Tensor]] = {}
    for key in BATCH_KEYS:
        value = batch.get(key)
        if value is not None and not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        if value is not None and device is not None:
            value = value.to(device, non_blocking=True)
        out[key] = value
    tokens = out["tokens"]
    if state.batch_lengths is not None and tokens is not None and tokens.dim() == 2:
        state.batch_lengths[tokens.shape[1]] += tokens.shape[0]  # shapes are on the host: no wait
    if state.cfg.model.context_parallel_size > 1:
        from megatron.core.utils import get_batch_on_this_cp_rank

        out = get_batch_on_this_cp_rank(out)
    return out


def packed_seq_params(cu_seqlens: torch.Tensor):
    """megatron-core's PackedSeqParams ('thd') for one packed sequence (micro batch size 1):
    `cu_seqlens` holds the sample boundaries, padded with -1."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if cu_seqlens.shape[0] != 1:
        raise ValueError(f"packed sequences with TransformerEngine need micro batch size 1, got {cu_seqlens.shape[0]}")
    cu = cu_seqlens[0]
    cu = cu[cu >= 0].to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def masked_next_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor, state: Optional[GlobalState] = None):
    """Sum of per-token losses where `loss_mask` is 1, the token count, and the reported value.

    NaN/Inf losses are rejected (fatally) and spiky losses reported through megatron-core's rerun
    state machine, as `state.cfg.rerun_state_machine` asks.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    if state is not None:
        _validate_loss(loss, state)
    reported = torch.cat([loss.detach().view(1), num_tokens.detach().view(1).float()])
    return loss, num_tokens, {"lm loss": reported}


def _validate_loss(loss: torch.Tensor, state: GlobalState) -> None:
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    rerun = state.cfg.rerun_state_machine
    machine = get_rerun_state_machine()
    if rerun.check_for_nan_in_loss and state.unchecked_losses is not None and machine.mode == RerunMode.DISABLED:
        # Checked once per step (`check_step_losses`): a check per micro batch would wait for
        # the GPU twice per micro batch and leave it idle while the next one is launched.
        state.unchecked_losses.append(loss.detach())
    elif rerun.check_for_nan_in_loss:
        machine.validate_result(
            result=loss, rejection_func=torch.isnan, message="found NaN in the loss", tolerance=0.0, fatal=True
        )
        machine.validate_result(
            result=loss, rejection_func=torch.isinf, message="found Inf in the loss", tolerance=0.0, fatal=True
        )
    if rerun.check_for_spiky_loss:
        machine.validate_result(
            result=loss,
            rejection_func=partial(machine.is_unexpectedly_large, threshold=rerun.spiky_loss_factor, context="loss"),
            message="spiky loss",
            tolerance=0.0,
            fatal=False,
        )


def defer_loss_checks(state: GlobalState) -> None:
    """Collect the losses of the micro batches that follow for one `check_step_losses`."""
    state.unchecked_losses = []


def check_step_losses(state: GlobalState) -> None:
    """Raise the error megatron-core's result validation raises if a loss collected since
    `defer_loss_checks` was NaN or Inf: in training before the optimizer step, so no update is
    made from it."""
    losses, state.unchecked_losses = state.unchecked_losses, None
    if not losses:
        return
    stacked = torch.stack(losses)
    bad = ~torch.isfinite(stacked)
    if not bad.any():  # the one wait for the device per step
        return
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    value = float(stacked[bad][0])
    kind = "NaN" if value != value else "Inf"
    iteration = get_rerun_state_machine().current_iteration
    raise RuntimeError(
        f"Rank {state.rank}, node {os.uname()[1]}, iteration {iteration}: "
        f"Unexpected result {value} (message='found {kind} in the loss')"
    )


def forward_step(state: GlobalState, data_iterator: Iterator[dict], model: torch.nn.Module, return_schedule_plan: bool = False):
    """Run one micro batch through `model`; return (per-token losses, loss function) as
    megatron-core's pipeline schedules expect."""
    timers = state.timers
    if timers is not None:
        timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator, state)
    if timers is not None:
        timers("batch-generator").stop()
    extra = {}
    if batch["cu_seqlens"] is not None:
        extra["packed_seq_params"] = packed_seq_params(batch["cu_seqlens"])
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],  # multi-token prediction masks its own losses with it
        **extra,
    )
    return output, partial(masked_next_token_loss, batch["loss_mask"], state=state)
