"""Memory of each distinct rank layout: model state, activations, a fixed workspace allowance.

Ranks differ by pipeline stage (which layers, the embedding, the output layer, micro batches in
flight); tensor-, context- and expert-parallel ranks of a stage hold the same amounts, and with
the distributed optimizer data-parallel ranks differ by a few padding elements at most (the
largest shard is reported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_bridge.planning.activations import StageActivations, stage_activations
from megatron_bridge.planning.buffers import StateBytes, state_bytes
from megatron_bridge.planning.inputs import PlanInputs
from megatron_bridge.planning.params import Chunk, chunk_params, chunks

WORKSPACE_BYTES = 4 * 2**30
"""Fixed allowance for what the model does not determine: the CUDA context, NCCL and cuBLAS
workspaces, temporary buffers of the optimizer step and allocator fragmentation."""


@dataclass
class RankMemory:
    """Bytes per GPU for the ranks of one pipeline stage."""

    pp_rank: int
    chunks: list[Chunk]
    state: StateBytes
    activations: StageActivations
    workspace: int
    gpu_bytes: int

    @property
    def layers(self) -> int:
        return sum(c.num_layers for c in self.chunks)

    @property
    def total(self) -> float:
        s = self.state
        return s.params + s.grads + s.optimizer + self.activations.total + self.workspace

    @property
    def margin(self) -> float:
        """Free bytes left (negative: over by this much)."""
        return self.gpu_bytes - self.total

    @property
    def fits(self) -> bool:
        return self.margin >= 0


def stage_state(
    inp: PlanInputs, stage: list[Chunk], dp_rank: Optional[int] = None, expert_dp_rank: Optional[int] = None
) -> StateBytes:
    """Parameter, gradient-buffer and optimizer bytes of one rank of `stage`; the data-parallel
    ranks pick the optimizer shard (None: the largest)."""
    params = [chunk_params(inp, c, names=False) for c in stage]
    return state_bytes(inp, params, stage[0].pp_rank, dp_rank, expert_dp_rank)


def rank_memory(
    inp: PlanInputs, gpu_bytes: int, workspace: int = WORKSPACE_BYTES, state_cache: Optional[dict] = None
) -> list[RankMemory]:
    """One `RankMemory` per pipeline stage. `state_cache` (keyed by `inp.state_key()`) lets
    re-plans that change only activations reuse the model-state bytes of the same architecture."""
    stages = chunks(inp)
    key = inp.state_key()
    states = state_cache.get(key) if state_cache is not None else None
    if states is None:
        states = [stage_state(inp, stage) for stage in stages]
        if state_cache is not None:
            state_cache[key] = states
    return [
        RankMemory(stage[0].pp_rank, stage, state, stage_activations(inp, stage), workspace, gpu_bytes)
        for stage, state in zip(stages, states)
    ]
