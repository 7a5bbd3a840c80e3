"""The model weights in a checkpoint of ours, as megatron-core sharded state dicts (all of them,
or the base or adapter part), and the entries every checkpoint records besides them (format
version, parallel layout). The whole state of a training run is
`megatron_bridge.training.checkpointing.state_dict`."""

from __future__ import annotations

from typing import Any

import torch

ADAPTER_PARAMS = ("lora_A", "lora_B", "lora_magnitude")
"""Names of adapter parameters (LoRA's two matrices, DoRA's magnitude vector): a state-dict key
ending in one of them belongs to an adapter."""

CHECKPOINT_VERSION = 1
"""Format version recorded in every checkpoint."""


def layout() -> dict[str, int]:
    """The parallel layout of this job (stored to decide whether per-rank state can be reused)."""
    from megatron.core import parallel_state as ps

    return {
        "world_size": torch.distributed.get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def is_adapter_key(key: str) -> bool:
    """Whether a (sharded) state-dict key names an adapter parameter."""
    return key.rsplit(".", 1)[-1] in ADAPTER_PARAMS


def unwrap(chunk: Any) -> Any:
    """The GPTModel inside the DDP and Float16Module wrappers (checkpoints hold the bare model's
    keys, so they do not depend on how it was wrapped)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


MODEL_PARTS = ("all", "base", "adapters")
"""Which weights a model entry holds: everything, the base weights of an adapted model (what a
pretrained checkpoint provides), or only its adapters (what a PEFT run saves)."""


def model_state(chunk: Any, part: str = "all") -> dict[str, Any]:
    """The sharded state dict of one model chunk, or of `part` of it.

    Adapter entries use one key per layer (`decoder.layers.3.`...) rather than megatron-core's
    layers stacked into one tensor per key, because adapters may sit on some layers only."""
    bare = unwrap(chunk)
    if part == "all":
        return bare.sharded_state_dict()
    if part == "adapters":
        sd = bare.sharded_state_dict(metadata={"non_homogeneous_layers": True})
        return {k: v for k, v in sd.items() if is_adapter_key(k)}
    return {k: v for k, v in bare.sharded_state_dict().items() if not is_adapter_key(k)}


def load_model_state(chunk: Any, state: dict[str, Any], part: str = "all") -> None:
    """Load `part` of a chunk's weights; the other part must be exactly what is missing."""
    bare = unwrap(chunk)
    if part == "all":
        bare.load_state_dict(state, strict=True)
        return
    result = bare.load_state_dict(state, strict=False)
    wrong_missing = [k for k in result.missing_keys if is_adapter_key(k) == (part == "adapters")]
    if result.unexpected_keys or wrong_missing:
        raise RuntimeError(
            f"loading the {part} weights: unexpected keys {result.unexpected_keys[:5]}, missing keys {wrong_missing[:5]}"
        )
