"""Model providers: GPT architectures as configs that also build their megatron-core model."""

from megatron_bridge.models.gpt_provider import GPTModelProvider
from megatron_bridge.models.llama import (
    Llama2ModelProvider,
    Llama2ModelProvider7B,
    Llama3ModelProvider,
    Llama3ModelProvider8B,
    Llama3ModelProvider70B,
    Llama31ModelProvider,
    Llama31ModelProvider405B,
    LlamaModelProvider,
)
from megatron_bridge.models.mistral import (
    MistralModelProvider,
    MistralModelProvider7B,
    MixtralModelProvider,
    MixtralModelProvider8x7B,
)
from megatron_bridge.models.param_count import ParameterCount, count_parameters, flops_per_token
from megatron_bridge.models.qwen import (
    Qwen2ModelProvider,
    Qwen3ModelProvider,
    Qwen3ModelProvider8B,
    Qwen3MoEModelProvider,
    Qwen3MoEModelProvider30B_A3B,
    Qwen25ModelProvider7B,
)
from megatron_bridge.models.tiny_gpt import TinyGPTModelProvider

__all__ = [
    "GPTModelProvider",
    "Llama2ModelProvider",
    "Llama2ModelProvider7B",
    "Llama31ModelProvider",
    "Llama31ModelProvider405B",
    "Llama3ModelProvider",
    "Llama3ModelProvider70B",
    "Llama3ModelProvider8B",
    "LlamaModelProvider",
    "MistralModelProvider",
    "MistralModelProvider7B",
    "MixtralModelProvider",
    "MixtralModelProvider8x7B",
    "ParameterCount",
    "Qwen25ModelProvider7B",
    "Qwen2ModelProvider",
    "Qwen3MoEModelProvider",
    "Qwen3MoEModelProvider30B_A3B",
    "Qwen3ModelProvider",
    "Qwen3ModelProvider8B",
    "TinyGPTModelProvider",
    "count_parameters",
    "flops_per_token",
]
