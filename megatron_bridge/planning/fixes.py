"""Changes that make a config fit, each re-planned, ranked.

A fix is a set of config changes (printed as overrides to paste on the command line). The search
applies one knob at a time to the inputs (cheap copies, not configs), re-plans each candidate with
the same planner, and keeps going from the most promising candidates that still do not fit:

1. at the configured world size: distributed optimizer, sequence parallelism, recompute
   (selective, then full), smaller micro batches, another TP x PP x CP layout, more expert
   parallelism, the precision-aware optimizer, optimizer offload to the host;
2. if nothing fits there, or only with the optimizer offloaded to the host (slow): the smallest
   larger world size (x2 .. x16) at which a layout fits.

Fixes that fit are ranked by estimated tokens/s (same world size first), and a fix is dropped
when a subset of its changes already fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from megatron_bridge.planning.inputs import PlanInputs, PlanningError

MAX_TP = 8
"""Tensor parallelism stays within a node (NVLink domain of 8 GPUs)."""


@dataclass
class Fix:
    """A set of changes, with the plan of the changed config."""

    changes: list[tuple[str, list[str]]]
    """(description, overrides) per knob."""
    evaluation: object
    """The `plan.Evaluation` of the changed config."""

    @property
    def inputs(self) -> PlanInputs:
        return self.evaluation.inputs

    @property
    def world_size(self) -> int:
        return self.inputs.world_size

    @property
    def overrides(self) -> list[str]:
        return [o for _, overrides in self.changes for o in overrides]

    @property
    def description(self) -> str:
        return "; ".join(d for d, _ in self.changes)


# ---------------------------------------------------------------------- validity
def _valid(inp: PlanInputs) -> bool:
    """The layout constraints megatron-core and the config enforce (the ones a knob can break)."""
    model_parallel = inp.tp * inp.pp * inp.cp
    if inp.world_size % model_parallel:
        return False
    dp = inp.world_size // model_parallel
    if inp.global_batch_size % (inp.micro_batch_size * dp):
        return False
    if inp.heads % inp.tp or inp.query_groups % inp.tp:
        return False
    if inp.sequence_parallel and inp.tp == 1:
        return False
    if inp.seq_length % (2 * inp.cp) and inp.cp > 1:
        return False
    if inp.is_moe:
        if inp.num_experts % inp.ep or inp.world_size % (inp.etp * inp.ep * inp.pp):
            return False
    slots = inp.num_layers + int(inp.embedding_in_pipeline_split) + int(inp.loss_in_pipeline_split)
    if inp.layers_first_stage is None and inp.layers_last_stage is None:
        if slots % inp.pp or (inp.vp and (slots // inp.pp) % inp.vp):
            return False
        if inp.vp and inp.num_microbatches % inp.pp:
            return False
    if inp.precision_aware and not inp.distributed_optimizer:
        return False
    return True


# ---------------------------------------------------------------------- moves
Move = Callable[[PlanInputs], Iterator[PlanInputs]]


def _distributed_optimizer(inp: PlanInputs) -> Iterator[PlanInputs]:
    if not inp.distributed_optimizer:
        yield inp.replace(distributed_optimizer=True)


def _sequence_parallel(inp: PlanInputs) -> Iterator[PlanInputs]:
    # megatron-core's local layers use torch norms, which refuse sequence parallelism
    if inp.tp > 1 and not inp.sequence_parallel and inp.transformer_engine:
        yield inp.replace(sequence_parallel=True)


def _recompute(inp: PlanInputs) -> Iterator[PlanInputs]:
    # selective recompute drops attention scores; SDPA keeps none
    if inp.recompute_granularity is None and inp.core_attention != "sdpa":
        yield inp.replace(recompute_granularity="selective", recompute_modules=("core_attn",))
    if inp.recompute_granularity != "full":
        yield inp.replace(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _micro_batch(inp: PlanInputs) -> Iterator[PlanInputs]:
    if inp.micro_batch_size > 1:
        yield inp.replace(micro_batch_size=inp.micro_batch_size // 2)


def _layouts(inp: PlanInputs) -> Iterator[PlanInputs]:
    """Other TP x PP x CP splits of the same world size (sequence parallel with TP > 1)."""
    sizes = [1, 2, 4, 8, 16, 32, 64]
    te = inp.transformer_engine  # local layers have neither context nor sequence parallelism
    max_cp = 16 if te else 1
    for tp in (t for t in sizes if t <= MAX_TP):
        for pp in sizes:
            for cp in (c for c in sizes if c <= max_cp):
                if (tp, pp, cp) == (inp.tp, inp.pp, inp.cp) or inp.world_size % (tp * pp * cp):
                    continue
                slots = inp.num_layers + int(inp.embedding_in_pipeline_split) + int(inp.loss_in_pipeline_split)
                keep_vp = pp > 1 and inp.vp and slots % pp == 0 and (slots // pp) % inp.vp == 0
                vp = inp.vp if keep_vp else None
                etp = tp if inp.etp == inp.tp else inp.etp
                yield inp.replace(tp=tp, pp=pp, cp=cp, vp=vp, etp=etp, sequence_parallel=tp > 1 and te)


def _expert_parallel(inp: PlanInputs) -> Iterator[PlanInputs]:
    if inp.is_moe:
        yield inp.replace(ep=inp.ep * 2)


def _precision_aware(inp: PlanInputs) -> Iterator[PlanInputs]:
    if inp.distributed_optimizer and not inp.precision_aware and inp.optimizer == "adam" and inp.param_bytes == 2:
        yield inp.replace(
            precision_aware=True, exp_avg_bytes=2, exp_avg_sq_bytes=2, main_params_bytes=4, store_param_remainders=False
        )


def _offload(inp: PlanInputs) -> Iterator[PlanInputs]:
    if inp.distributed_optimizer and inp.cpu_offload_fraction < 1.0:
        yield inp.replace(cpu_offload_fraction=1.0)


SAME_WORLD_MOVES: tuple[Move, ...] = (
    _distributed_optimizer,
    _sequence_parallel,
    _recompute,
    _micro_batch,
    _layouts,
    _expert_parallel,
    _precision_aware,
    _offload,
)
LARGER_WORLD_MOVES: tuple[Move, ...] = (_distributed_optimizer, _sequence_parallel, _recompute, _layouts)


# ---------------------------------------------------------------------- describing a change
def changes(base: PlanInputs, new: PlanInputs) -> list[tuple[str, list[str]]]:
    """The knobs that differ between `base` and `new`, as (description, overrides)."""
    out: list[tuple[str, list[str]]] = []
    if new.world_size != base.world_size:
        out.append((f"use {new.world_size} GPUs instead of {base.world_size}", [f"--world-size {new.world_size}"]))
    if new.distributed_optimizer != base.distributed_optimizer:
        out.append(
            (
                "shard optimizer state over data-parallel ranks (distributed optimizer)",
                ["ddp.use_distributed_optimizer=true"],
            )
        )
    if (new.tp, new.pp, new.cp, new.vp) != (base.tp, base.pp, base.cp, base.vp):
        desc = f"layout TP {new.tp} x PP {new.pp} x CP {new.cp}"
        overrides = []
        for key, old, value in (
            ("tensor_model", base.tp, new.tp),
            ("pipeline_model", base.pp, new.pp),
            ("context", base.cp, new.cp),
        ):
            if value != old:
                overrides.append(f"model.{key}_parallel_size={value}")
        if new.vp != base.vp:
            overrides.append(f"model.virtual_pipeline_model_parallel_size={new.vp if new.vp else 'null'}")
            desc += f" (virtual stages: {new.vp or 'none'})"
        if new.cp == 1 and base.cp > 1 and base.transformer_engine and base.local_core_attention != "te":
            # planned with TE layers because of CP (TE is not installed here): keep them explicitly
            overrides.append("model.transformer_impl=transformer_engine")
        if new.etp != base.etp and new.is_moe:
            overrides.append(f"model.expert_tensor_parallel_size={new.etp}")
        out.append((desc + f", was TP {base.tp} x PP {base.pp} x CP {base.cp}", overrides))
    if new.sequence_parallel != base.sequence_parallel:
        out.append(
            (
                f"sequence parallel {'on' if new.sequence_parallel else 'off'}",
                [f"model.sequence_parallel={str(new.sequence_parallel).lower()}"],
            )
        )
    if new.ep != base.ep:
        out.append((f"expert parallel {new.ep}, was {base.ep}", [f"model.expert_model_parallel_size={new.ep}"]))
    if new.recompute_granularity != base.recompute_granularity:
        if new.recompute_granularity == "full":
            out.append(
                (
                    "recompute every layer in the backward pass (full, ~+33% compute)",
                    [
                        "model.recompute_granularity=full",
                        "model.recompute_method=uniform",
                        "model.recompute_num_layers=1",
                    ],
                )
            )
        else:
            out.append(("recompute attention scores (selective)", ["model.recompute_granularity=selective"]))
    if new.micro_batch_size != base.micro_batch_size:
        out.append(
            (
                f"micro batch {new.micro_batch_size}, was {base.micro_batch_size}",
                [f"train.micro_batch_size={new.micro_batch_size}"],
            )
        )
    if new.precision_aware != base.precision_aware:
        out.append(
            (
                "bf16 Adam moments (precision-aware optimizer; needs TransformerEngine)",
                [
                    "optimizer.use_precision_aware_optimizer=true",
                    "optimizer.exp_avg_dtype=bf16",
                    "optimizer.exp_avg_sq_dtype=bf16",
                ],
            )
        )
    if new.cpu_offload_fraction != base.cpu_offload_fraction:
        out.append(
            (
                "optimizer state and step on the host (optimizer CPU offload; slower steps)",
                [
                    "optimizer.optimizer_cpu_offload=true",
                    f"optimizer.optimizer_offload_fraction={new.cpu_offload_fraction}",
                ],
            )
        )
    return out


# ---------------------------------------------------------------------- search
def _signature(inp: PlanInputs) -> tuple:
    return (
        inp.world_size,
        inp.tp,
        inp.pp,
        inp.cp,
        inp.vp,
        inp.ep,
        inp.sequence_parallel,
        inp.distributed_optimizer,
        inp.recompute_granularity,
        inp.micro_batch_size,
        inp.precision_aware,
        inp.cpu_offload_fraction,
    )


def _search(planner, starts: list[PlanInputs], moves: tuple[Move, ...], depth: int, beam: int, seen: set) -> list:
    found, frontier = [], starts
    for _ in range(depth):
        candidates = []
        for inp in frontier:
            relaid = (inp.tp, inp.pp, inp.cp) != (starts[0].tp, starts[0].pp, starts[0].cp)
            for move in moves:
                if move is _layouts and relaid:
                    continue  # one change of layout per fix; the other knobs refine it
                for new in move(inp):
                    sig = _signature(new)
                    if sig in seen or not _valid(new):
                        continue
                    seen.add(sig)
                    try:
                        ev = planner.evaluate(new)
                    except PlanningError:
                        continue
                    (found if ev.fits else candidates).append(ev)
        candidates.sort(key=lambda ev: ev.worst.margin, reverse=True)
        frontier = [ev.inputs for ev in candidates[:beam]]
        if not frontier:
            break
    return found


def find_fixes(planner, current, limit: int = 5, depth: int = 3, beam: int = 3, larger: int = 2) -> list[Fix]:
    """Ranked fixes for `current` (a non-fitting `Evaluation`), each re-planned by `planner`: up to
    `limit` at the configured world size, then, when none fits there without offloading the
    optimizer to the host, up to `larger` at the smallest larger world size where one fits."""
    base = current.inputs
    seen = {_signature(base)}
    same = _ranked(base, _search(planner, [base], SAME_WORLD_MOVES, depth, beam, seen))[:limit]
    if same and all(f.inputs.cpu_offload_fraction == 0 for f in same):
        return same
    for factor in (2, 4, 8, 16):
        start = base.replace(world_size=base.world_size * factor)
        if not _valid(start):
            start = start.replace(tp=1, pp=1, cp=1, vp=None, sequence_parallel=False)
        found = _search(planner, [start], LARGER_WORLD_MOVES, depth, beam, seen)
        if _valid(start):
            ev = planner.evaluate(start)
            if ev.fits:
                found.append(ev)
        if found:
            more = _ranked(base, found)[:larger]
            return _without_supersets(same[: limit - len(more)] + more)
    return same


def _without_supersets(fixes: list[Fix]) -> list[Fix]:
    """`fixes` (in order) without any whose changes include all of another's."""
    sets = [frozenset(f.overrides) for f in fixes]
    return [f for f, own in zip(fixes, sets) if not any(other < own for other in sets)]


def _ranked(base: PlanInputs, found: list) -> list[Fix]:
    """Fixes best first (estimated tokens/s, then fewer changes), without any whose changes
    include all of a better one's."""
    fixes = [Fix(changes(base, ev.inputs), ev) for ev in found]
    sets = [frozenset(f.overrides) for f in fixes]
    minimal, kept = [], set()
    for fix, own in zip(fixes, sets):
        if own in kept or any(other < own for other in sets):
            continue
        kept.add(own)
        minimal.append(fix)
    minimal.sort(key=lambda f: (-f.evaluation.timing.tokens_per_s, len(f.overrides)))
    return minimal
