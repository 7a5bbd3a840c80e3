"""`plan()`: memory per GPU, fit, time and layout of a resolved config, and fixes when it does
not fit. A pure function of the config: no GPU is touched and no model is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_bridge.planning.devices import DEFAULT_GPU, GPU, get_gpu
from megatron_bridge.planning.inputs import PlanInputs
from megatron_bridge.planning.memory import WORKSPACE_BYTES, RankMemory, rank_memory
from megatron_bridge.planning.timing import DEFAULT_MFU, Timing, timing
from megatron_bridge.planning.fixes import find_fixes
from megatron_bridge.planning.report import json_records, plan_text


@dataclass
class Evaluation:
    """Memory and time of one set of inputs on a GPU."""

    inputs: PlanInputs
    ranks: list[RankMemory]
    timing: Timing

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    @property
    def worst(self) -> RankMemory:
        """The rank layout with the least memory left."""
        return min(self.ranks, key=lambda r: r.margin)


@dataclass
class Planner:
    """Evaluates inputs against one GPU and MFU; `base` anchors FLOPs and the stated MFU."""

    gpu: GPU
    mfu: float
    base: PlanInputs
    base_flops_per_token: float
    workspace: int = WORKSPACE_BYTES
    state_cache: dict = field(default_factory=dict)
    """Model-state bytes per `PlanInputs.state_key()` (the architecture is fixed per planner)."""

    def evaluate(self, inp: PlanInputs) -> Evaluation:
        ranks = rank_memory(inp, self.gpu.memory_bytes, self.workspace, self.state_cache)
        reference = None if inp is self.base else self.base
        t = timing(inp, self.base_flops_per_token, self.base.padded_vocab, self.gpu.peak_flops, self.mfu, reference)
        return Evaluation(inp, ranks, t)


@dataclass
class Plan(Evaluation):
    """The plan of a config: its evaluation, the GPU and MFU assumed, and ranked fixes."""

    gpu: GPU = None  # type: ignore[assignment]
    mfu: float = DEFAULT_MFU
    label: str = ""
    fixes: list[Any] = field(default_factory=list)
    """`fixes.Fix` objects, best first (empty when the config fits)."""

    def text(self) -> list[str]:
        """The plan as lines of text."""
        return plan_text(self)

    def to_json(self) -> list[dict[str, Any]]:
        """One record per rank layout (pipeline stage)."""
        return json_records(self)


def plan(
    cfg: Any,
    gpu: str = DEFAULT_GPU,
    mfu: float = DEFAULT_MFU,
    world_size: Optional[int] = None,
    with_fixes: bool = True,
    label: str = "",
) -> Plan:
    """Plan `cfg` (resolved by `runtime_config_update`) on `gpu` (a key of `devices.GPUS`) at
    model FLOPs utilization `mfu`. Raises `PlanningError` for features the planner does not model."""
    from megatron_bridge.models.param_count import flops_per_token

    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be within (0, 1], got {mfu}")
    device = get_gpu(gpu)
    inp = PlanInputs.from_config(cfg, world_size)
    m = cfg.model
    planner = Planner(device, mfu, inp, flops_per_token(m, m.seq_length, inp.vocab_size))
    ev = planner.evaluate(inp)
    result = Plan(ev.inputs, ev.ranks, ev.timing, gpu=device, mfu=mfu, label=label)
    if with_fixes and not result.fits:
        result.fixes = find_fixes(planner, ev)
    return result
