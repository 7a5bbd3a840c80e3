"""What a checkpoint holds, as a megatron-core sharded state dict.

* `model` (or `model0`, `model1`, ... with virtual pipelining): sharded weights, reshardable
  across tensor/pipeline/data parallel sizes;
* `optimizer`: sharded optimizer state (optional);
* `rng_state`: one object per rank (Python, NumPy, torch, CUDA and megatron's tracker streams);
* common entries saved once: iteration, training counters, scheduler state, parallel layout.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from megatron_bridge.runtime.checkpointing.weights import CHECKPOINT_VERSION, layout, load_model_state, model_state

if TYPE_CHECKING:
    from megatron_bridge.training.train import Run

OPTIMIZER_SHARDING = "dp_reshardable"
"""Distributed-optimizer state layout: reshardable over data-parallel sizes, and supported on CPU."""


def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def model_keys(run: "Run") -> list[str]:
    return ["model"] if len(run.state.model) == 1 else [f"model{i}" for i in range(len(run.state.model))]


def rerun_machine_active() -> bool:
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    return get_rerun_state_machine().get_mode() != RerunMode.DISABLED


def build(
    run: "Run",
    *,
    for_loading: bool,
    with_optimizer: bool,
    with_rng: bool,
    with_common: bool,
    with_rerun: bool = False,
    rerun_requested: bool = False,
    model_part: str = "all",
    peft_base: Optional[tuple[str, int]] = None,
) -> dict[str, Any]:
    """The sharded state dict of `run` (what gets saved, or the template a load fills in).

    `with_rerun` adds the state of megatron-core's rerun state machine (result validation);
    `rerun_requested` (the machine asked for this checkpoint) adds the data iterators' replay state
    so the resumed job re-runs the suspicious step on the same data. `model_part` picks the
    weights (see `runtime.checkpointing.weights.MODEL_PARTS`); a PEFT run saves and resumes its
    adapters only, and records `peft_base` (the directory and iteration of the base weights it loaded).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd: dict[str, Any] = {}
    for key, chunk in zip(model_keys(run), run.state.model):
        sd[key] = model_state(chunk, model_part)
    # Adam's state exists only after the first step: nothing to save before it.
    with_optimizer = with_optimizer and (for_loading or run.state.train_state.step > 0)
    if with_optimizer:
        metadata = {"distrib_optim_sharding_type": OPTIMIZER_SHARDING}
        sd["optimizer"] = run.state.optimizer.sharded_state_dict(sd, is_loading=for_loading, metadata=metadata)
    if with_rng:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        sd["rng_state"] = ShardedObject("rng_state", rng_state(), (world,), (rank,), replica_id=0)
    if with_common:
        sd["checkpoint_version"] = CHECKPOINT_VERSION
        sd["iteration"] = run.state.train_state.step
        sd["train_state"] = run.state.train_state.state_dict()
        sd["opt_param_scheduler"] = run.state.scheduler.state_dict()
        sd["layout"] = layout()
        sd["saved_rng"] = with_rng
        sd["saved_optimizer"] = with_optimizer
        sd["saved_rerun"] = with_rerun
        ft = run.state.fault_tolerance
        sd["ft_state"] = ft.state_dict() if ft is not None else None
        if model_part == "adapters":
            sd["peft"] = peft_record(run.state.cfg, peft_base)
    if with_rerun:
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        iterator = run.train_iterator if rerun_requested else None
        sd["rerun_state_machine"] = get_rerun_state_machine().state_dict(iterator, "torch_dist", force=for_loading)
    return sd


def peft_record(cfg: Any, base: Optional[tuple[str, int]]) -> dict[str, Any]:
    """What an adapter checkpoint records about its run: the method and the base it was trained on."""
    import os

    record: dict[str, Any] = {
        "method": cfg.peft.method_name,
        "pretrained_checkpoint": os.path.abspath(cfg.checkpoint.pretrained_checkpoint),
    }
    if base is not None:
        record["pretrained_iteration_dir"] = os.path.abspath(base[0])
        record["pretrained_iteration"] = base[1]
    return record
