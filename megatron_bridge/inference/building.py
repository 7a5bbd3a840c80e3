"""Building the model of a checked source and loading its weights (megatron-core, the model
code, the conversions): what `inference.model.load_model` imports once the source is resolved."""

from __future__ import annotations

from typing import Any, Optional

from megatron_bridge.config.errors import Problems
from megatron_bridge.inference.errors import SourceError
from megatron_bridge.inference.sources import ADAPTERS, HF, ModelSource, read_run_config
from megatron_bridge.models.hf.config import read_hf_config
from megatron_bridge.models.hf.convert import checkpoint_provider, default_dtype
from megatron_bridge.models.hf.load import check_hf_directory, load_hf_weights
from megatron_bridge.models.hf.runtime import (
    build_chunks,
    load_checkpoint_weights,
    model_parallel,
    prepare,
    stored_dtype,
)
from megatron_bridge.models.hf.writer import torch_dtype
from megatron_bridge.peft.apply import apply_peft, base_weights_loaded
from megatron_bridge.peft.offline import load_weights

__all__ = ["build", "model_parallel"]


def provider_of(src: ModelSource) -> Any:
    """The model provider of `src`: from its config.json, or the run config of our checkpoint."""
    if src.kind == HF:
        problems = Problems()
        provider = check_hf_directory(src.directory, problems)
        if provider is None:
            lines = [f"  - {p.message}" + (f" ({p.fix})" if p.fix else "") for p in problems.items]
            raise SourceError("\n".join([f"the Hugging Face model {src.directory!r} cannot be loaded:", *lines]))
        return provider

    try:
        return checkpoint_provider(src.directory)
    except (ValueError, TypeError) as exc:
        raise SourceError(f"the model of {src.describe()} cannot be read: {exc}") from None


def weights_dtype(src: ModelSource, provider: Any, dtype: Optional[str]) -> Any:
    """The dtype to load the weights in: `dtype`, else the one they are stored in."""
    if dtype is not None:
        return torch_dtype(dtype)
    if src.kind == HF:
        return torch_dtype(default_dtype(provider, read_hf_config(src.directory)))

    return stored_dtype(provider)


def build(src: ModelSource, device: str, dtype: Optional[str]) -> tuple[Any, Any]:
    """(the loaded GPTModel, its provider) of `src` in the current parallel state."""
    weights = src.base if src.kind == ADAPTERS else src
    provider = provider_of(src)  # adapters: the architecture their run trained (the base's)
    layout: dict[str, Any] = {"bf16": False, "fp16": False, "parallel_output": False,
                              "moe_token_dispatcher_type": "allgather"}  # fmt: skip
    if src.kind == ADAPTERS:
        layout["transformer_impl"] = "local"  # adapters wrap megatron-core's local linear layers
    provider = prepare(provider, device, params_dtype=weights_dtype(weights, provider, dtype), **layout)
    (module,) = build_chunks(provider, device)
    _load_complete_weights(module, weights)
    if src.kind == ADAPTERS:
        _add_adapters(module, src)
    module.eval()
    return module, provider


def _load_complete_weights(module: Any, src: ModelSource) -> None:
    if src.kind == HF:
        load_hf_weights([module], src.directory)
        return

    try:
        load_checkpoint_weights([module], src.directory)
    except Exception as exc:  # dist_checkpointing names mismatched tensors in many exception types
        raise SourceError(f"the weights of {src.describe()} do not fit its model: {exc}") from None


def _add_adapters(module: Any, src: ModelSource) -> None:
    saved = read_run_config(src.directory)
    peft = saved.build("peft")
    seed = saved.value("rng", "seed")
    seed = 1234 if seed is None else int(seed)  # RNGConfig's default
    apply_peft(module, peft, seed=seed)
    base_weights_loaded(module)
    load_weights(module, src.directory, "adapters")
