"""Model providers: GPT architectures as configs that also build their megatron-core model."""

from megatron_bridge.models.gpt_provider import GPTModelProvider
from megatron_bridge.models.param_count import ParameterCount, count_parameters, flops_per_token

__all__ = ["GPTModelProvider", "ParameterCount", "count_parameters", "flops_per_token"]
