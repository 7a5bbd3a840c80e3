"""Model sections of saved runs compared by architecture: the fields that decide which weights
exist and their shapes (`ARCHITECTURE_FIELDS`), which of them differ between two sections
(`differing_fields`), and whether weights can be the base of trained adapters (`base_mismatch`,
for `generate`, `eval` and `peft merge --base`). Validation compares a run's checkpoints with its
config through them (`megatron_bridge.training.config.architecture`)."""

from __future__ import annotations

from typing import Optional

from megatron_bridge.config.errors import show
from megatron_bridge.config.serialization import to_dict
from megatron_bridge.models.gpt_provider import GPTModelProvider
from megatron_bridge.models.hf.config import WEIGHT_SHAPE_FIELDS
from megatron_bridge.models.hf.files import is_hf_directory
from megatron_bridge.runtime.checkpointing.layout import resolve
from megatron_bridge.runtime.checkpointing.run_config import read_run_config

ARCHITECTURE_FIELDS = (*WEIGHT_SHAPE_FIELDS, "activation_func")
"""Model fields that decide the shapes and meaning of the weights."""


def differing_fields(first: dict, second: dict, first_name: str, second_name: str) -> str:
    """'hidden_size: checkpoint 64, config 96; ...' for the architecture fields where two model
    sections differ ('' when none does); a field the second leaves unset is not compared."""
    differing = [
        n for n in ARCHITECTURE_FIELDS
        if n in first and second.get(n) is not None and first[n] != second[n]
    ]  # fmt: skip
    return "; ".join(f"{n}: {first_name} {show(first[n])}, {second_name} {show(second[n])}" for n in differing)


def base_mismatch(adapters_model: dict, base: str) -> Optional[str]:
    """Why the weights at `base` (a checkpoint of ours or a Hugging Face directory) cannot be the
    base of adapters trained on `adapters_model` (the model section of their run config), or None
    when they can (or `base` describes no model: its loading reports that)."""
    if is_hf_directory(base):
        base_model = to_dict(GPTModelProvider.from_hf(base))
    else:
        try:
            run_config = read_run_config(resolve(base)[0])
        except (OSError, ValueError):
            return None
        base_model = run_config.section("model") if run_config is not None else {}
    if not base_model:
        return None
    fields = differing_fields(base_model, adapters_model, "base", "adapters")
    if not fields:
        return None
    return (
        f"{base!r} holds a {describe(base_model)}, but the adapters were trained on a {describe(adapters_model)} "
        f"({fields}); give the base they were trained on, or leave it out to use the one they record"
    )


def describe(model: dict) -> str:
    """'LlamaModelProvider (32 layers, hidden size 4096, 32 attention heads)' from a model section."""
    kind = str(model.get("_target_") or "GPTModelProvider").rsplit(".", 1)[-1]
    sizes = [
        text.format(model[key])
        for key, text in (("num_layers", "{} layers"), ("hidden_size", "hidden size {}"),
                          ("num_attention_heads", "{} attention heads"), ("num_moe_experts", "{} experts"))
        if model.get(key)
    ]  # fmt: skip
    return f"{kind} ({', '.join(sizes)})" if sizes else kind
