"""What a log step reports: losses, learning rate, throughput and FLOPs utilization, memory,
timers; and what an evaluation reports. The same names go to the console and to every tracker.

`logger.log_*` switches decide which groups are produced: throughput (`log_throughput`), memory
(`log_memory_to_tensorboard`), timers (`log_timers_to_tensorboard`), loss scale
(`log_loss_scale_to_tensorboard`), world size (`log_world_size_to_tensorboard`) and validation
perplexity (`log_validation_ppl_to_tensorboard`).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Mapping, Optional

from megatron_bridge.extras import require
from megatron_bridge.models.param_count import flops_per_token
from megatron_bridge.runtime.gpu_peaks import peak_tflops_for
from megatron_bridge.training.console import perplexity

TIMER_NAMES = (
    # the train loop and checkpointing (this package)
    "optimizer", "batch-generator", "save-checkpoint",
    # megatron-core's schedules, gradient finalization and optimizer
    "forward-backward", "forward-compute", "backward-compute",
    "forward-recv", "forward-send", "backward-recv", "backward-send",
    "forward-send-forward-recv", "forward-send-backward-recv", "backward-send-forward-recv",
    "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync", "params-all-gather",
    "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
    "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params",
)  # fmt: skip
"""Timers reported at log steps (those whose level is above `timing_log_level` never run). The
same list on every rank: gathering them is collective."""

def peak_tflops(logger_cfg: Any, device: str) -> Optional[float]:
    """`logger.peak_tflops_per_device`, else the table's value for this GPU; None on CPU."""
    if logger_cfg.peak_tflops_per_device is not None:
        return float(logger_cfg.peak_tflops_per_device)
    if device != "cuda":
        return None
    import torch

    return peak_tflops_for(torch.cuda.get_device_name())


def throughput(cfg: Any, step_time: float, global_batch: int, world_size: int, device: str, step_flops: Optional[float] = None) -> dict[str, float]:
    """`tflops-per-device` from the model shape (`flops_per_token`), and `mfu` (fraction of the
    device's peak) where the peak is known. `step_flops`: the FLOPs of a step as its batches were
    (`processed_work`); by default `global_batch` sequences of `model.seq_length` tokens."""
    if step_time <= 0:
        return {}
    if step_flops is None:
        seq = cfg.model.seq_length
        step_flops = flops_per_token(cfg.model, seq, cfg.model.vocab_size) * seq * global_batch
    tflops = step_flops / step_time / max(1, world_size) / 1e12
    out = {"tflops-per-device": tflops}
    peak = peak_tflops(cfg.logger, device)
    if peak:
        out["mfu"] = tflops / peak
    return out


def memory(device: str) -> dict[str, float]:
    """Peak CUDA memory allocated on GPU (bytes); resident set size of this process on CPU."""
    if device == "cuda":
        import torch

        return {
            "mem-max-allocated-bytes": float(torch.cuda.max_memory_allocated()),
            "mem-reserved-bytes": float(torch.cuda.memory_reserved()),
        }
    import psutil

    return {"mem-rss-bytes": float(psutil.Process().memory_info().rss)}


def timer_values(state: Any, steps: int) -> dict[str, float]:
    """Timer seconds per iteration since the last log step, max across ranks, as
    `<name>-time`; collective (call on every rank). Empty when nothing asks for timers."""
    log = state.cfg.logger
    if state.timers is None or log.timing_log_level < 0:
        return {}
    if log.timing_log_level < 1 and not log.log_timers_to_tensorboard:
        return {}
    # What Timers.log/.write report, without their printing or their SummaryWriter type check.
    reduced = state.timers._get_global_min_max_time(list(TIMER_NAMES), True, False, max(1, steps))
    return {f"{name}-time": max_time for name, (_, max_time) in reduced.items()}


def params_norm(model_chunks: list, moe: bool) -> float:
    """L2 norm of all model parameters, each counted once across the model-parallel ranks;
    collective (call on every rank).

    Parameters replicated across tensor-parallel ranks (norms, biases) and the second copy of
    tied embeddings are left out locally. With `moe`, expert parameters are summed over their own
    (expert-tensor x expert x pipeline) group; the others over the tensor x pipeline group.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    device = next(model_chunks[0].parameters()).device
    dense_sq, expert_sq = torch.zeros(1, device=device), torch.zeros(1, device=device)
    for chunk in model_chunks:
        for p in chunk.parameters():
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                square = p.detach().float().pow(2).sum()
                if getattr(p, "allreduce", True):
                    dense_sq += square
                else:
                    expert_sq += square
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(dense_sq, group=parallel_state.get_model_parallel_group())
        if moe:  # the same decision on every rank, whether or not this stage holds experts
            torch.distributed.all_reduce(expert_sq, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return float(torch.sqrt(dense_sq + expert_sq).item())


class EnergyMeter:
    """GPU energy through NVML's cumulative counter (`logger.log_energy`); GPU only (on CPU the
    setting is a configuration error)."""

    def __init__(self, device: str):
        if device != "cuda":
            raise RuntimeError("logger.log_energy reads GPU energy counters and needs a CUDA GPU")

        import torch

        self.nvml = require("pynvml", "logger.log_energy")
        self.nvml.nvmlInit()
        index = torch.cuda.current_device()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:  # NVML numbers the physical devices
            index = int(visible.split(",")[index])
        self.handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
        self.start_mj = self._read_mj()
        self.last_mj, self.last_time = self.start_mj, time.perf_counter()

    def _read_mj(self) -> int:
        return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def read(self) -> tuple[float, float]:
        """(joules this device used since training started, its mean watts since the last read)."""
        now_mj, now = self._read_mj(), time.perf_counter()
        watts = (now_mj - self.last_mj) / 1000.0 / max(now - self.last_time, 1e-9)
        self.last_mj, self.last_time = now_mj, now
        return (now_mj - self.start_mj) / 1000.0, watts


def reduced_metrics(state: Any, model_chunks: list, energy_meter: Optional[EnergyMeter]) -> dict[str, float]:
    """The metrics every rank contributes to (collective): `params-norm` (`log_params_norm`) and,
    summed over all devices, `energy-joules` and `power-watts` (`log_energy`)."""
    out: dict[str, float] = {}
    if state.cfg.logger.log_params_norm:
        out["params-norm"] = params_norm(model_chunks, moe=bool(state.cfg.model.num_moe_experts))
    if energy_meter is not None:
        import torch

        joules, watts = energy_meter.read()
        totals = torch.tensor([joules, watts], dtype=torch.float64, device=state.device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(totals)
        out["energy-joules"], out["power-watts"] = totals.tolist()
    return out


def reset_loss_trackers() -> None:
    """Empty megatron-core's process-wide trackers of MTP and MoE auxiliary losses: a run in a
    process that trained before would otherwise log the earlier run's losses, or reduce them
    over process groups that no longer exist."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    get_moe_layer_wise_logging_tracker().clear()


def mtp_losses(microbatches: int, dp_group: Any) -> dict[str, float]:
    """`mtp_<k> loss`: the loss of each multi-token-prediction depth over the training micro
    batches since the last call (`microbatches` of them), averaged over the data-parallel ranks.
    megatron-core adds each micro batch's to its tracker on the last pipeline stage; the tracker
    is emptied here. Collective over `dp_group` where the tracker holds values; {} elsewhere."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    values = MTPLossLoggingHelper.tracker.get("values")
    if values is None:
        return {}
    totals = values.detach().clone().double()
    values.zero_()
    ranks = 1
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals, group=dp_group)  # summed: gloo has no average
        ranks = torch.distributed.get_world_size(group=dp_group)
    return {f"mtp_{k} loss": v / (ranks * max(1, microbatches)) for k, v in enumerate(totals.tolist(), 1)}


_BALANCING_LOSSES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}
"""megatron-core's load-balancing types and the names its routers record their losses under."""


def moe_loss_names(model: Any) -> list[str]:
    """The auxiliary losses the routers of `model` (a provider with experts) compute: each
    load-balancing type with a nonzero coefficient, and the z-loss."""
    types, coeffs = model.moe_router_load_balancing_type, model.moe_aux_loss_coeff
    if not isinstance(types, list):
        types, coeffs = [types], [coeffs]
    names = [_BALANCING_LOSSES[t] for t, c in zip(types, coeffs) if t in _BALANCING_LOSSES and c]
    return names + (["z_loss"] if model.moe_z_loss_coeff else [])


def moe_losses(model: Any, microbatches: int, device: Any) -> dict[str, float]:
    """The routers' auxiliary losses since the last call (`microbatches` training micro batches),
    each the mean over the MoE layers, as megatron-core logs them (without their coefficients):
    summed over pipeline stages and the group each router names, averaged over data-parallel
    ranks (as a sum divided by the size: gloo has no average). The tracker is emptied.
    Collective on every rank, each loss in the same order."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    freq, layers = model.moe_layer_freq, model.num_layers
    moe_layers = sum(freq) if isinstance(freq, list) else sum(1 for i in range(layers) if i % freq == 0)
    moe_layers += model.mtp_num_layers or 0
    distributed = torch.distributed.is_initialized()

    def average(values: Any, group: Any) -> None:
        torch.distributed.all_reduce(values, group=group)
        values /= torch.distributed.get_world_size(group=group)

    out = {}
    for name in moe_loss_names(model):
        entry = tracker.get(name, {})
        values = entry.get("values")
        if values is None:  # no MoE layer on this pipeline stage: it still joins the collectives
            values = torch.zeros(layers + (model.mtp_num_layers or 0), dtype=torch.float64, device=device)
        values = values.detach().double()
        if distributed:
            torch.distributed.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
            if entry.get("reduce_group") is not None:
                torch.distributed.all_reduce(values, group=entry["reduce_group"])
                if not entry.get("reduce_group_has_dp"):
                    average(values, ps.get_data_parallel_group())
            if entry.get("avg_group") is not None:
                average(values, entry["avg_group"])
        out[name] = values.sum().item() / max(1, moe_layers) / max(1, microbatches)
    if tracker:
        clear_aux_losses_tracker()
    return out


def processed_work(model: Any, lengths: Mapping[int, int], device: str) -> Optional[tuple[float, float]]:
    """(tokens, training FLOPs) of the micro batches counted in `lengths` ({sequence length:
    sequences} on this rank), summed over the data-parallel ranks; None when nothing was counted
    (a forward step that does not use `gpt_step.get_batch`). Collective on every rank."""
    import torch

    tokens = sum(length * n for length, n in lengths.items())
    flops = sum(flops_per_token(model, length, model.vocab_size) * length * n for length, n in lengths.items())
    if torch.distributed.is_initialized():
        from megatron.core import parallel_state

        # Context-parallel ranks count the same sequences, so the group leaves them out.
        totals = torch.tensor([tokens, flops], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        tokens, flops = totals.tolist()
    return (tokens, flops) if tokens > 0 else None


def train_metrics(
    state: Any,
    optimizer: Any,
    interval: Any,
    losses: Mapping[str, float],
    timers: Mapping[str, float],
    global_batch: int,
    work: Optional[tuple[float, float]] = None,
) -> dict[str, float]:
    """The metrics of one log step. `interval`: steps, seconds, skipped, nan, grad_norm since the
    last log step; `work`: (tokens, FLOPs) its batches held (`processed_work`), else `global_batch`
    sequences of `model.seq_length` tokens per step."""
    cfg, log, ts = state.cfg, state.cfg.logger, state.train_state
    step_time = interval.seconds / max(1, interval.steps)
    tokens_per_step = work[0] / max(1, interval.steps) if work else global_batch * cfg.model.seq_length
    metrics = {
        **losses,
        "learning-rate": float(optimizer.param_groups[0]["lr"]),
        "iteration-time": step_time,
        "tokens-per-second": tokens_per_step / step_time if step_time > 0 else 0.0,
        "batch-size": float(global_batch),
        "consumed-samples": float(ts.consumed_train_samples),
        "skipped-iterations": float(interval.skipped),
        "nan-iterations": float(interval.nan),
    }
    if math.isfinite(interval.grad_norm):
        metrics["grad-norm"] = interval.grad_norm
    if log.log_loss_scale_to_tensorboard:
        metrics["loss-scale"] = float(optimizer.get_loss_scale())
    if log.log_throughput:
        step_flops = work[1] / max(1, interval.steps) if work else None
        metrics.update(throughput(cfg, step_time, global_batch, state.world_size, state.device, step_flops))
    if log.log_memory_to_tensorboard:
        metrics.update(memory(state.device))
    if log.log_world_size_to_tensorboard:
        metrics["world-size"] = float(state.world_size)
    if log.log_timers_to_tensorboard:
        metrics.update(timers)
    return metrics


def eval_metrics(losses: Mapping[str, float], split: str, with_ppl: bool) -> dict[str, float]:
    """`<name> <split>` for each loss, and `<name> <split> ppl` if `with_ppl`."""
    out = {}
    for key, value in losses.items():
        out[f"{key} {split}"] = value
        if with_ppl:
            out[f"{key} {split} ppl"] = perplexity(value)
    return out
