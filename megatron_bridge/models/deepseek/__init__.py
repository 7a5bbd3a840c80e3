"""DeepSeek-V3 and the models built on its architecture: the providers (`providers`) and the
Hugging Face family (`hf`, registered when this package is imported)."""

from megatron_bridge.models.deepseek.providers import (
    DeepSeekModelProvider,
    DeepSeekV3ModelProvider,
    MoonlightModelProvider16B,
    dense_then_moe,
    leading_dense_layers,
)
from megatron_bridge.models.deepseek import hf  # noqa: E402,F401 (registers DeepseekV3Family)

__all__ = [
    "DeepSeekModelProvider",
    "DeepSeekV3ModelProvider",
    "MoonlightModelProvider16B",
    "dense_then_moe",
    "leading_dense_layers",
]
