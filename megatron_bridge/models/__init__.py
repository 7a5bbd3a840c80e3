"""Model providers: GPT architectures as configs that also build their megatron-core model.

The family providers load on first use: each defines dataclasses over megatron-core's large
`TransformerConfig`, and the config layer needs only `GPTModelProvider`.

Adding a family: one module here (`megatron_bridge/models/<family>.py`, or a package when it is
long: `models.deepseek` keeps its Hugging Face family in `models.deepseek.hf`) holds its providers (the
architecture as plain defaults, published sizes as subclasses) and, for a Hugging Face
architecture, an `HFFamily` subclass decorated with `@register` (`models.hf.family`,
`models.hf.registry`): its `architecture`/`model_type`, how config.json becomes provider fields
(refusing by name what it cannot reproduce), the provider settings it can write back and its
config.json, and which Hugging Face tensors make each megatron-core parameter (`Mapped` entries
with the `Rule`s of `models.hf.mapping`). It overrides only what differs from the Llama-style
defaults of `HFFamily`. Then list the module and its provider names in `_FAMILIES` below;
`GPTModelProvider.from_hf`, `mbridge hf import|export`, the weight checks and the peft export
find it there. Layer structure megatron-core's specs lack is built from `models.layers` by provider
fields (`input_layernorms`, `output_layernorms`, `qk_layernorm_per_head`); a family's provider can
edit the built spec further in `adjust_layer_spec`. `models.olmo2` is a family with layers of its
own, `models.phi3` one whose Hugging Face files fuse projections, `models.gemma` one with a RoPE
base per layer type and soft-capping.
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_bridge.config.targets import register_lazy_exports
from megatron_bridge.models import activations  # noqa: F401 (registers the functions configs may name)
from megatron_bridge.models.gpt_provider import GPTModelProvider
from megatron_bridge.models.param_count import ParameterCount, count_parameters, flops_per_token

_FAMILIES = {
    "megatron_bridge.models.deepseek": ("DeepSeekModelProvider", "DeepSeekV3ModelProvider", "MoonlightModelProvider16B"),
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
    "megatron_bridge.models.gemma": (
        "Gemma2ModelProvider",
        "Gemma3ModelProvider",
        "Gemma3ModelProvider1B",
        "Gemma3ModelProvider4B",
        "Gemma3ModelProvider27B",
    ),
    "megatron_bridge.models.gpt_oss": ("GptOssModelProvider", "GptOssModelProvider20B", "GptOssModelProvider120B"),
    "megatron_bridge.models.olmo2": ("Olmo2ModelProvider", "Olmo2ModelProvider7B"),
    "megatron_bridge.models.phi3": ("Phi3ModelProvider", "Phi3ModelProviderMini"),
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
register_lazy_exports("megatron_bridge.models", _WHERE)  # configs name them before they are imported

__all__ = ["GPTModelProvider", "ParameterCount", "count_parameters", "flops_per_token", *sorted(_WHERE)]


def family_modules() -> list[str]:
    """The modules defining model families (those with Hugging Face architectures register them
    when imported)."""
    return list(_FAMILIES)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_bridge.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
