"""Small configs that tests build on (importable from any test module)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

from megatron_bridge.models import GPTModelProvider
from megatron_bridge.training.config import (
    ConfigContainer,
    MockGPTDatasetConfig,
    OptimizerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron_bridge.training.tokenizers.config import TokenizerConfig


def tiny_model(**kw) -> GPTModelProvider:
    args = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        position_embedding_type="rope",
        transformer_impl="local",
    )
    args.update(kw)
    return GPTModelProvider(**args)


def tiny_config(**sections) -> ConfigContainer:
    """A valid single-process config of a tiny GPT on mock data; keyword args replace sections."""
    args = dict(
        train=TrainingConfig(train_iters=20, global_batch_size=8, micro_batch_size=2),
        model=tiny_model(),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4),
        dataset=MockGPTDatasetConfig(seq_length=32, num_workers=0),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=256),
        validation=ValidationConfig(eval_interval=10, eval_iters=2),
    )
    args.update(sections)
    return ConfigContainer(**args)


def tiny_llama_model(**kw) -> GPTModelProvider:
    """A tiny Llama-style model (RMSNorm, SwiGLU, grouped-query attention, no biases, untied
    output layer, no dropout): what the PEFT tests adapt and compare with transformers' Llama."""
    import torch.nn.functional as F

    args = dict(
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        share_embeddings_and_output_weights=False, num_query_groups=2, ffn_hidden_size=128,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    args.update(kw)
    return tiny_model(**args)


class SequenceParallelNorm:
    """torch's LayerNorm/RMSNorm with megatron-core's `sequence_parallel` mark on its weights (so
    their gradients are summed over tensor-parallel ranks). megatron-core's own torch-norm wrapper
    refuses sequence parallelism; its fused alternatives need CUDA."""

    def __new__(cls, config, hidden_size, eps=1e-5, **unused):
        import torch

        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def sequence_parallel_layer_spec(provider, vp_stage=None):
    """megatron-core's local layers, with norms that support sequence parallelism on CPU."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = get_gpt_layer_local_spec(normalization=provider.normalization)
    layer.submodules = dataclasses.replace(
        layer.submodules, input_layernorm=SequenceParallelNorm, pre_mlp_layernorm=SequenceParallelNorm
    )
    count = get_num_layers_to_build(provider, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=SequenceParallelNorm)


def one_process_group():
    """A 1-process gloo group (an in-memory store: no port that parallel test workers could race
    for), unless one exists; a context manager that destroys the group it made."""
    import contextlib

    import torch.distributed as dist

    from megatron_bridge.runtime.distributed import single_process_store

    @contextlib.contextmanager
    def group():
        owned = not dist.is_initialized()
        if owned:
            dist.init_process_group("gloo", store=single_process_store(), rank=0, world_size=1)
        try:
            yield
        finally:
            if owned:
                dist.destroy_process_group()

    return group()


def backend_for(ranks: int) -> str:
    """The process-group backend of a test job of `ranks` processes on this machine, asked for
    explicitly (never `auto`): NCCL on the GPUs when each rank can have its own, else gloo on
    CPU. Runs whose results are compared use the backend of the largest among them."""
    import torch

    return "nccl" if torch.cuda.device_count() >= ranks else "gloo"


def backend_overrides(ranks: int) -> list[str]:
    """`backend_for(ranks)` as a command-line config override."""
    return [f"dist.distributed_backend={backend_for(ranks)}"]


def torchrun(nproc: int) -> list[str]:
    """The command that starts a single-node job of `nproc` processes. torchrun picks and holds
    its own rendezvous port (`--standalone`): a port chosen free beforehand could be taken by
    another test's connections before torchrun binds it (tests run in parallel on GPU machines)."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for its processes: a test's subprocess must not inherit them."""

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The source tree these tests belong to."""


def source_tree_env(**extra: str) -> dict:
    """This process's environment for a subprocess that must import this source tree: the tree
    first on PYTHONPATH, what PYTHONPATH held kept after it (where the dependencies may be, when
    the project runs from source), and no launcher variables of an enclosing torchrun."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def on_cpu(cfg):
    """`cfg` as a CPU run on every machine (gloo: GPUs, where there are any, stay unused); for
    tests of what a CPU run does. Returns `cfg`."""
    cfg.dist.distributed_backend = "gloo"
    return cfg


def missing_packages(*modules: str) -> list[str]:
    """Those of `modules` (optional packages) that are not installed, checked without importing."""
    import importlib.util

    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ImportError:
            return False

    return [m for m in modules if not installed(m)]


def needs(*modules: str) -> None:
    """Skip the calling test, naming what is missing, unless every module in `modules` (optional
    packages) is installed."""
    import pytest

    missing = missing_packages(*modules)
    if missing:
        pytest.skip(f"needs the optional package(s) {', '.join(missing)}, not installed here")


def tiny_deepseek_model(**kw) -> GPTModelProvider:
    """A tiny DeepSeek-V3-architecture model: multi-latent attention (low-rank queries), the first
    layer dense, the second a mixture of 4 experts (2 per token) with a shared expert, sigmoid
    routing with expert bias; local layers, sequential experts."""
    from megatron_bridge.models import DeepSeekModelProvider

    args = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, seq_length=32, vocab_size=256,
        q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12, kv_channels=12,
        rope_type="rope",
        mscale_all_dim=0.0, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1], moe_router_num_groups=None,
        moe_router_group_topk=None, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
        transformer_impl="local", init_method_std=0.02,
    )  # fmt: skip
    args.update(kw)
    return DeepSeekModelProvider(**args)


class _OnDemand(Mapping):
    """`start(name)` for each of `names`, called when a test first asks for that name."""

    def __init__(self, names: Iterable[str], start: Callable[[str], Any]):
        self._names, self._start, self._started = list(names), start, {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._started:
            if name not in self._names:
                raise KeyError(name)
            self._started[name] = self._start(name)
        return self._started[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def started(names: Iterable[str], start: Callable[[str], Any]) -> Mapping[str, Any]:
    """`{name: start(name)}` for a module fixture that starts all its tests' processes at once, so
    that they overlap. Under pytest-xdist each starts when a test first asks for it instead: every
    worker that runs one of the module's tests builds the fixture, and would start them all."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return _OnDemand(names, start)
    return {name: start(name) for name in names}
