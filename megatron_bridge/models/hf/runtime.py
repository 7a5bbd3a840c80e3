"""A model without a training run: process groups, the model chunks of this rank, and their
weights in our checkpoint format. Used by `mbridge hf import|export` (and their tests and
benchmark), which need the model but no optimizer, data or loop.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import shutil
from typing import Any, Iterator, Optional

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.data.config import MockGPTDatasetConfig
from megatron_bridge.models.experts import GROUPED_GEMM_FIX, machine_decision
from megatron_bridge.models.hf.files import copy_hf_assets
from megatron_bridge.runtime.checkpointing.results_queue import use_results_queue
from megatron_bridge.config.serialization import from_dict, to_dict
from megatron_bridge.runtime import cpu_backend
from megatron_bridge.runtime.checkpointing import layout, weights
from megatron_bridge.runtime.checkpointing.safe_reading import check_pickled_files
from megatron_bridge.runtime.checkpointing.weights import load_model_state, model_state
from megatron_bridge.runtime.cpu_backend import CPU_MODEL_SETTINGS
from megatron_bridge.runtime.distributed import checked_backend, single_process_store
from megatron_bridge.runtime.launcher_env import launcher_int
from megatron_bridge.warning_filters import checkpoint_loading

logger = logging.getLogger("megatron_bridge")


@contextlib.contextmanager
def model_parallel(tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None, seed: int = 1234,
                   timeout_minutes: int = 30, backend: str = "auto") -> Iterator[str]:
    """Join the launcher's process group (or create a one-process one) with `backend` (auto:
    nccl on GPUs where they are visible, else gloo on CPU), run megatron-core's CUDA calls on the
    CPU for gloo, set up tensor/pipeline/expert parallel state; undo it all on exit. Yields the
    device ("cuda" or "cpu"). A launch with more processes than GPUs for NCCL raises
    `ConfigValidationError` before anything is set up."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    backend = checked_backend(backend, launcher_int("LOCAL_RANK", 0), setting="--backend")
    device = "cuda" if backend == "nccl" else "cpu"
    created = activated = False
    if device == "cuda":
        torch.cuda.set_device(launcher_int("LOCAL_RANK", 0))
    if not dist.is_initialized():
        single = "RANK" not in os.environ
        dist.init_process_group(
            backend=backend,
            store=single_process_store() if single else None,
            rank=0 if single else launcher_int("RANK"),
            world_size=1 if single else launcher_int("WORLD_SIZE"),
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
        created = True
    try:
        if device == "cpu":
            activated = cpu_backend.activate(device)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        model_parallel_cuda_manual_seed(seed)
        yield device
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if activated:
            cpu_backend.deactivate()
        if created:
            dist.destroy_process_group()


def prepare(provider: Any, device: str, params_dtype: Any = None, initialize: bool = False, **layout: Any) -> Any:
    """A finalized copy of `provider` laid out as the current parallel state, buildable on
    `device`: megatron-core's local layers and no fused kernels on CPU, parameters in
    `params_dtype`, random initialization only if `initialize` (weights are loaded anyway)."""
    from megatron.core import parallel_state as ps

    p = copy.copy(provider)
    p.apply_default("tensor_model_parallel_size", ps.get_tensor_model_parallel_world_size())
    p.apply_default("pipeline_model_parallel_size", ps.get_pipeline_model_parallel_world_size())
    p.apply_default("expert_model_parallel_size", ps.get_expert_model_parallel_world_size())
    p.apply_default("expert_tensor_parallel_size", ps.get_expert_tensor_parallel_world_size())
    for name in ("virtual_pipeline_model_parallel_size", "pipeline_dtype"):
        p.apply_default(name, None)
    p.apply_default("context_parallel_size", 1)
    p.apply_default("sequence_parallel", False)
    if device == "cpu":
        for name, value in CPU_MODEL_SETTINGS.items():
            p.apply_default(name, value)
    else:
        _adapt_expert_mlp(p)
    if params_dtype is not None:
        p.apply_default("params_dtype", params_dtype)
    p.apply_default("perform_initialization", initialize)
    for name, value in layout.items():
        p.apply_default(name, value)
    p.finalize()
    return p


def _adapt_expert_mlp(provider: Any) -> None:
    """Grouped-GEMM experts on a GPU without a grouped GEMM: sequential experts where the
    grouped GEMM was a default, a config error where it was asked for (see models.experts)."""
    decision = machine_decision(provider)
    if decision.refused:
        raise ConfigValidationError(ConfigProblem("model.moe_grouped_gemm", decision.message, GROUPED_GEMM_FIX))
    if decision.message is not None:
        provider.apply_default("moe_grouped_gemm", decision.grouped_gemm)
        logger.info(decision.message)


def build_chunks(provider: Any, device: str) -> list[Any]:
    """The bare GPTModel of this rank's pipeline stage (a one-element list, like a run's chunks)."""
    import torch
    from megatron.core import tensor_parallel

    model = provider.provide()
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if device == "cuda":
        model.cuda(torch.cuda.current_device())
    model.eval()
    return [model]


def stored_dtype(provider: Any) -> Any:
    """The dtype a training run of `provider` keeps its model weights (and checkpoints) in."""
    import torch

    if provider.bf16:
        return torch.bfloat16
    if provider.fp16:
        return torch.float16
    return provider.params_dtype


def load_checkpoint_weights(chunks: list[Any], directory: str, part: str = "all") -> None:
    """Fill `chunks` (or `part` of their weights, see `weights.MODEL_PARTS`) from our checkpoint
    iteration directory `directory` (resharded to this layout by dist_checkpointing)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    check_pickled_files(directory)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    template = {key: model_state(chunk, part) for key, chunk in zip(keys, chunks)}
    with checkpoint_loading():
        loaded = dist_checkpointing.load(template, directory, get_default_load_sharded_strategy(directory),
                                         strict="assume_ok_unexpected")  # fmt: skip
    for key, chunk in zip(keys, chunks):
        load_model_state(chunk, loaded[key], part)


def _own_storage(sd: dict, chunks: list[Any]) -> None:
    """Give every tensor of the sharded state dict its own storage, freeing model parameters as
    their parts are copied. megatron-core's writer copies each tensor that is a view (the halves
    of a gated MLP weight) and keeps the copies until the save ends; copying one parameter at a
    time and releasing it instead keeps memory at the model's size. The model is unusable after."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sd)
    params = {p.data.untyped_storage().data_ptr(): p for chunk in chunks for p in chunk.parameters()}
    views: dict[int, list[Any]] = {}
    for item in nested_values(sd):
        if isinstance(item, ShardedTensor) and item.data is not None and item.data.device.type == "cpu":
            data = item.data
            if data.untyped_storage().nbytes() != data.numel() * data.element_size():
                views.setdefault(data.untyped_storage().data_ptr(), []).append(item)
    for storage, items in views.items():
        for item in items:
            item.data = item.data.clone()
        param = params.get(storage)
        if param is not None:
            param.data = torch.empty(0, dtype=param.dtype)


def save_checkpoint_weights(chunks: list[Any], out_dir: str, run_config: Any, assets: Optional[str] = None,
                            iteration: int = 0) -> str:
    """Write the weights of `chunks` as a checkpoint of ours (weights only) under `out_dir`:
    `iter_NNNNNNN/` with `run_config` as run_config.yaml and the Hugging Face config and
    tokenizer files of `assets` in `hf/`, then the tracker. Returns the iteration directory.
    Consumes the model (see `_own_storage`)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    final = layout.iteration_dir(out_dir, iteration)
    staging = final + layout.INCOMPLETE_SUFFIX
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    sd: dict[str, Any] = {key: chunk.sharded_state_dict() for key, chunk in zip(keys, chunks)}
    _own_storage(sd, chunks)
    sd.update(
        checkpoint_version=weights.CHECKPOINT_VERSION, iteration=iteration, layout=weights.layout(),
        saved_rng=False, saved_optimizer=False, saved_rerun=False, weights_only=True,
    )  # fmt: skip
    use_results_queue(persistent_worker=False)  # no helper process for the writer's results
    dist_checkpointing.save(sd, staging, TorchDistSaveShardedStrategy("torch_dist", 1))
    dist.barrier()
    if rank == 0:
        run_config.to_yaml(os.path.join(staging, layout.RUN_CONFIG_FILE))
        copy_hf_assets(assets, staging)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(staging, final)
        layout.write_tracker(out_dir, iteration)
    dist.barrier()
    return final


def weights_only_config(provider: Any, tokenizer_dir: Optional[str], origin: Optional[str]) -> Any:
    """A loadable run config describing a weights-only checkpoint of `provider` (its model
    section is what loading and exporting read). It is written as data and decoded by the
    registered config classes, as a saved run config is when it is read back."""
    if tokenizer_dir:
        tokenizer = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tokenizer_dir}
    else:
        tokenizer = {"tokenizer_type": "NullTokenizer", "vocab_size": provider.vocab_size}
    return from_dict({
        "_target_": "megatron_bridge.ConfigContainer",
        "train": {"train_iters": 0, "global_batch_size": 1, "micro_batch_size": 1},
        "model": to_dict(provider),
        "optimizer": {},
        "dataset": to_dict(MockGPTDatasetConfig(seq_length=provider.seq_length)),
        "tokenizer": tokenizer,
        "checkpoint": {"pretrained_checkpoint": origin},
    })  # fmt: skip
