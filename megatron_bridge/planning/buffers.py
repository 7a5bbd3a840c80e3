"""Parameter, gradient and optimizer-state bytes of one rank, as megatron-core allocates them.

megatron-core's `DistributedDataParallel` puts each model chunk's parameters (grouped by
dense/expert and by dtype) into contiguous gradient buffers split into buckets; with the
distributed optimizer the parameters move into a matching buffer too, every parameter starts at
a multiple of 64 elements and every bucket is padded to a multiple of lcm(DP, 128) so it splits
evenly over the data-parallel ranks. Each rank's optimizer then owns one contiguous shard of every
bucket. This module replays that layout (`_ParamAndGradBuffer`, `DistributedOptimizer`) on the
parameter list of `params.py`, so the bytes come out exact, padding included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from megatron_bridge.planning.inputs import PlanInputs
from megatron_bridge.planning.params import Param


@dataclass
class Buffer:
    """One `_ParamAndGradBuffer`: its size and, per bucket, the parameter ranges in it."""

    param_bytes: int
    grad_bytes: int
    dp_size: int
    expert: bool
    numel: int = 0
    buckets: list[tuple[int, int, list[tuple[int, int]]]] = field(default_factory=list)
    """(start, end, [(param start, param end), ...]) per bucket, in buffer order."""


def _pad(n: int, divisor: int) -> int:
    # megatron-core divides in floats; in integers the result is the same below 2**53 elements and
    # still a multiple of `divisor` (never smaller than `n`) above
    return -(-n // divisor) * divisor


def build_buffer(
    params: list[Param],
    param_bytes: int,
    grad_bytes: int,
    dp_size: int,
    expert: bool,
    bucket_size: Optional[int],
    dist_opt: bool,
    high_busbw: bool,
) -> Buffer:
    """The layout `_ParamAndGradBuffer.__init__` computes for `params` (registration order)."""
    buf = Buffer(param_bytes, grad_bytes, dp_size, expert)
    divisor = math.lcm(dp_size, 128, 2**16) if high_busbw else math.lcm(dp_size, 128)
    bucket_start = param_start = 0
    current: list[tuple[int, int]] = []

    def close_bucket(end: int) -> int:
        nonlocal bucket_start, current
        padded = _pad(end, divisor) if dist_opt else end
        buf.buckets.append((bucket_start, padded, current))
        bucket_start, current = padded, []
        return padded

    param_end = 0
    for p in reversed(params):  # megatron-core fills buffers in reverse (backward) order
        if dist_opt:
            param_start = _pad(param_start, 64)
        own_bucket = p.shared_embedding and dist_opt
        if own_bucket and current:
            param_start = close_bucket(param_start)
        param_end = param_start + p.numel
        current.append((param_start, param_end))
        if (bucket_size is not None and param_end - bucket_start >= bucket_size) or own_bucket:
            param_start = close_bucket(param_end)
        else:
            param_start = param_end
    if current:
        close_bucket(param_end)
    buf.numel = buf.buckets[-1][1] if buf.buckets else 0
    return buf


def chunk_buffers(inp: PlanInputs, params: list[Param], first_chunk_of_rank: bool, pp_rank: int) -> list[Buffer]:
    """The buffers of one model chunk: dense parameters over DP x CP, expert parameters over the
    expert data-parallel group; one buffer per (param dtype, grad dtype)."""
    bucket_size = inp.bucket_size
    if bucket_size is None:
        bucket_size = max(40_000_000, 1_000_000 * inp.dp)  # megatron-core's default (DP without CP)
    if not inp.overlap_grad_reduce or not first_chunk_of_rank or pp_rank > 0:
        bucket_size = None  # megatron-core: no bucketing without overlap, on later chunks and stages > 0
    grad_of = lambda pb: 4 if inp.grad_reduce_in_fp32 else pb  # noqa: E731
    out = []
    dense_dp = inp.dp * inp.cp // inp.num_dist_opt_instances
    expert_dp = inp.expert_dp // inp.num_dist_opt_instances
    for expert, dp_size in ((False, dense_dp), (True, expert_dp)):
        groups: dict[tuple[int, int], list[Param]] = {}
        for p in params:
            if p.expert != expert or not p.trainable:  # DDP leaves frozen parameters out
                continue
            pb = 1 if p.fp8 else inp.param_bytes
            groups.setdefault((pb, grad_of(2 if p.fp8 else inp.param_bytes)), []).append(p)
        for (pb, gb), members in groups.items():
            out.append(
                build_buffer(
                    members,
                    pb,
                    gb,
                    dp_size,
                    expert,
                    bucket_size,
                    inp.distributed_optimizer,
                    inp.pad_buckets_for_high_nccl_busbw,
                )
            )
    return out


@dataclass
class StateBytes:
    """Model-state bytes of one rank."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    """Main (fp32) parameters and optimizer moments on the GPU."""
    optimizer_host: int = 0
    """Optimizer state moved to host memory (`optimizer_cpu_offload`)."""
    step_counters: int = 0
    """torch's Adam keeps a 4-byte step counter per parameter tensor in host memory on GPUs."""
    owned_elements: int = 0
    """Parameter elements this rank's optimizer updates."""
    trainable_elements: int = 0
    """Parameter elements of this rank that train (all but a PEFT run's frozen base)."""
    frozen_elements: int = 0
    """Parameter elements of this rank that do not train (a PEFT run's base)."""


def optimizer_bytes_per_element(inp: PlanInputs) -> tuple[int, int]:
    """(main-parameter bytes, moment bytes) per owned element."""
    sixteen_bit = inp.param_bytes == 2
    if inp.precision_aware:
        main = (
            (2 if inp.store_param_remainders and inp.main_params_bytes == 4 else inp.main_params_bytes)
            if sixteen_bit
            else 0
        )
        return main, inp.exp_avg_bytes + inp.exp_avg_sq_bytes
    main = 4 if sixteen_bit else 0  # fp32 parameters are their own main parameters
    if inp.optimizer == "adam":
        return main, 8
    return main, 4 if inp.sgd_momentum > 0 else 0


def state_bytes(
    inp: PlanInputs,
    chunk_params: list[list[Param]],
    pp_rank: int,
    dp_rank: Optional[int] = None,
    expert_dp_rank: Optional[int] = None,
) -> StateBytes:
    """Bytes of parameters, gradient buffers and optimizer state of one rank holding the model
    chunks `chunk_params`. With the distributed optimizer the shard depends on the data-parallel
    rank (and the expert data-parallel rank for expert weights); `None` takes the largest."""
    out = StateBytes()
    main_b, moment_b = optimizer_bytes_per_element(inp)
    # per data-parallel rank: [elements, parameter pieces], for dense and expert buffers
    shards = {False: None, True: None}
    owned = pieces = 0
    for i, params in enumerate(chunk_params):
        for buf in chunk_buffers(inp, params, i == 0, pp_rank):
            out.grads += buf.numel * buf.grad_bytes
            if inp.distributed_optimizer:
                out.params += buf.numel * buf.param_bytes
                shards[buf.expert] = _add_shards(shards[buf.expert], buf)
        trained = params
        if inp.peft is not None:  # the frozen base stays in its own 16-bit tensors
            trained = [p for p in params if p.trainable]
            frozen = [p for p in params if not p.trainable]
            out.params += sum(p.numel * (1 if p.fp8 else inp.param_bytes) for p in frozen)
            out.frozen_elements += sum(p.numel for p in frozen)
        elements = sum(p.numel for p in trained)
        out.trainable_elements += elements
        if not inp.distributed_optimizer:
            out.params += sum(p.numel * (1 if p.fp8 else inp.param_bytes) for p in trained)
            owned += elements
            pieces += len(trained)
    for expert, rank in ((False, dp_rank), (True, expert_dp_rank)):
        per_rank = shards[expert]
        if per_rank is None:
            continue
        if rank is None:
            rank = max(range(len(per_rank)), key=lambda r: per_rank[r])
        owned += per_rank[rank][0]
        pieces += per_rank[rank][1]
    total = owned * (main_b + moment_b)
    host = int(total * inp.cpu_offload_fraction)
    out.optimizer, out.optimizer_host = total - host, host
    if inp.torch_optimizer and inp.optimizer == "adam" and not inp.precision_aware:
        out.step_counters = 4 * pieces
    out.owned_elements = owned
    return out


def _add_shards(per_rank: Optional[list[list[int]]], buf: Buffer) -> list[list[int]]:
    """Add to `per_rank` ([elements, pieces] per data-parallel rank) what each rank owns of `buf`:
    every bucket is cut into `dp_size` equal shards, and a rank's optimizer holds the parts of the
    parameters that fall into its shard (padding is owned by nobody)."""
    if per_rank is None:
        per_rank = [[0, 0] for _ in range(buf.dp_size)]
    for start, end, members in buf.buckets:
        shard = (end - start) // buf.dp_size
        for p_start, p_end in members:
            for r in range((p_start - start) // shard, (p_end - 1 - start) // shard + 1):
                lo = max(p_start, start + r * shard)
                hi = min(p_end, start + (r + 1) * shard)
                if hi > lo:
                    per_rank[r][0] += hi - lo
                    per_rank[r][1] += 1
    return per_rank
