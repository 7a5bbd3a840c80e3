"""Model providers: GPT architectures as configs that also build their megatron-core model.

The family providers load on first use: each defines dataclasses over megatron-core's large
`TransformerConfig`, and the config layer needs only `GPTModelProvider`.
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_bridge.models.gpt_provider import GPTModelProvider
from megatron_bridge.models.param_count import ParameterCount, count_parameters, flops_per_token

_FAMILIES = {
    "megatron_bridge.models.llama": (
        "LlamaModelProvider",
        "Llama2ModelProvider",
        "Llama2ModelProvider7B",
        "Llama3ModelProvider",
        "Llama3ModelProvider8B",
        "Llama3ModelProvider70B",
        "Llama31ModelProvider",
        "Llama31ModelProvider405B",
    ),
    "megatron_bridge.models.mistral": (
        "MistralModelProvider",
        "MistralModelProvider7B",
        "MixtralModelProvider",
        "MixtralModelProvider8x7B",
    ),
    "megatron_bridge.models.qwen": (
        "Qwen2ModelProvider",
        "Qwen25ModelProvider7B",
        "Qwen3ModelProvider",
        "Qwen3ModelProvider8B",
        "Qwen3MoEModelProvider",
        "Qwen3MoEModelProvider30B_A3B",
    ),
    "megatron_bridge.models.tiny_gpt": ("TinyGPTModelProvider",),
}
_WHERE = {name: module for module, names in _FAMILIES.items() for name in names}

__all__ = ["GPTModelProvider", "ParameterCount", "count_parameters", "flops_per_token", *sorted(_WHERE)]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_bridge.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
