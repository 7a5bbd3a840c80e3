"""A run's model in one process, outside training: for merging adapters and for tests.

`single_process_model(cfg)` builds the model of a config (with its adapters when `cfg.peft` is
set) unsplit (TP = PP = CP = EP = 1) on the CPU, in a one-process gloo group it creates and
destroys; `load_weights` fills it from checkpoints, which megatron-core reshards on load.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_bridge.models.vocab import derive_vocab_size
from megatron_bridge.config.errors import Problems
from megatron_bridge.models.hf.files import is_hf_directory
from megatron_bridge.models.hf.load import load_hf_weights
from megatron_bridge.peft.apply import apply_peft
from megatron_bridge.runtime import cpu_backend
from megatron_bridge.runtime.checkpointing import layout, weights
from megatron_bridge.runtime.checkpointing.safe_reading import check_pickled_files
from megatron_bridge.runtime.distributed import init_model_parallel, init_process_group, teardown
from megatron_bridge.warning_filters import checkpoint_loading

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer


def unsplit_config(cfg: "ConfigContainer") -> "ConfigContainer":
    """A copy of `cfg` whose model is laid out for one CPU process."""
    cfg = copy.deepcopy(cfg)
    m = cfg.model
    vocab = m.vocab_size
    for name, value in (
        ("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1), ("context_parallel_size", 1),
        ("expert_model_parallel_size", 1), ("expert_tensor_parallel_size", 1), ("sequence_parallel", False),
        ("virtual_pipeline_model_parallel_size", None), ("num_layers_in_first_pipeline_stage", None),
        ("num_layers_in_last_pipeline_stage", None), ("pipeline_model_parallel_layout", None),
        ("tp_comm_overlap", False), ("fp8", None), ("fp4", None),
    ):  # fmt: skip
        setattr(m, name, value)
    cfg.dist.distributed_backend = "gloo"
    cpu_backend.adapt_config(cfg, Problems())  # fused CUDA kernels off, local layers, CPU initialization
    m.finalize()
    if m.vocab_size is None and vocab is not None:  # derived from the tokenizer when the run started
        m.apply_default("vocab_size", vocab)
    if m.vocab_size is None:
        derive_vocab_size(cfg, Problems())  # a NullTokenizer's size
    if m.vocab_size is None:
        raise ValueError("model.vocab_size is not set (and the tokenizer's size is not known without loading it)")
    return cfg


@contextlib.contextmanager
def single_process_model(cfg: "ConfigContainer", with_adapters: bool = True) -> Iterator[Any]:
    """Yield the bare megatron-core model of `cfg` (unsplit, on the CPU; adapted when `cfg.peft`
    is set and `with_adapters`); process groups and the CPU backend live for the block only."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cfg = unsplit_config(cfg)
    device, created = init_process_group(cfg)
    activated = cpu_backend.activate(device)
    try:
        init_model_parallel(cfg)
        torch.manual_seed(cfg.rng.seed)
        model_parallel_cuda_manual_seed(cfg.rng.seed)
        model = cfg.model.provide(pre_process=True, post_process=True)
        if with_adapters and cfg.peft is not None:
            apply_peft(model, cfg.peft, seed=cfg.rng.seed)
        model.eval()
        yield model
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        teardown(destroy_group=created)
        if activated:
            cpu_backend.deactivate()


def load_weights(model: Any, directory: str, part: str = "all", step: Optional[int] = None) -> tuple[str, int]:
    """Load `part` (see `weights.MODEL_PARTS`) of the checkpoint at `directory` (a save
    directory or one `iter_*` directory) into `model`; returns the iteration directory and number.
    A Hugging Face directory provides the base weights (`part` 'all' or 'base'), as iteration 0."""
    from megatron.core import dist_checkpointing

    if is_hf_directory(directory) and part != "adapters":
        load_hf_weights([model], directory)
        return directory, 0
    iteration_dir, iteration = layout.resolve(directory, step)
    check_pickled_files(iteration_dir)
    template = weights.model_state(model, part)
    with checkpoint_loading():
        loaded = dist_checkpointing.load({"model": template}, iteration_dir)
    weights.load_model_state(model, loaded["model"], part)
    return iteration_dir, iteration
