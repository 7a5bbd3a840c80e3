"""The recipe library: functions returning a complete `ConfigContainer` for a model and layout.

    from recipes import get_recipe, list_recipes
    cfg = get_recipe("llama3_8b_pretrain_config")(dir="/results", train_iters=1000)

Each recipe records the number of GPUs it is laid out for in `fn.world_size`; its keyword
arguments (see `recipes._options`) override its defaults.
"""

from __future__ import annotations

import difflib
from typing import Callable

from megatron_bridge.training.config import ConfigContainer
from recipes._base import RECIPES
from recipes.deepseek import deepseek_v3_pretrain_config, moonlight_16b_pretrain_config
from recipes.gemma import (
    gemma3_1b_lora_finetune_config,
    gemma3_1b_pretrain_config,
    gemma3_4b_lora_finetune_config,
    gemma3_4b_pretrain_config,
    gemma3_27b_lora_finetune_config,
    gemma3_27b_pretrain_config,
)
from recipes.gpt_oss import (
    gpt_oss_20b_lora_finetune_config,
    gpt_oss_20b_pretrain_config,
    gpt_oss_120b_lora_finetune_config,
    gpt_oss_120b_pretrain_config,
)
from recipes.llama import (
    llama2_7b_pretrain_config,
    llama3_8b_finetune_config,
    llama3_8b_lora_finetune_config,
    llama3_8b_pretrain_config,
    llama3_70b_pretrain_config,
    llama31_405b_pretrain_config,
)
from recipes.mistral import mistral_7b_pretrain_config, mixtral_8x7b_pretrain_config
from recipes.olmo2 import olmo2_7b_lora_finetune_config, olmo2_7b_pretrain_config
from recipes.phi3 import phi3_mini_lora_finetune_config, phi3_mini_pretrain_config
from recipes.qwen import (
    qwen3_8b_finetune_config,
    qwen3_8b_lora_finetune_config,
    qwen3_8b_pretrain_config,
    qwen3_30b_a3b_pretrain_config,
    qwen25_7b_pretrain_config,
)
from recipes.tiny_gpt import tiny_gpt_finetune_config, tiny_gpt_lora_finetune_config, tiny_gpt_pretrain_config


class UnknownRecipeError(KeyError, ValueError):
    """No recipe has the requested name (a KeyError and a ValueError)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def list_recipes() -> list[str]:
    """Names of all recipes, sorted."""
    return sorted(RECIPES)


def get_recipe(name: str) -> Callable[..., ConfigContainer]:
    """The recipe function called `name` (the '_config' suffix may be left out); an
    `UnknownRecipeError` naming the closest recipes otherwise."""
    for key in (name, f"{name}_config"):
        if key in RECIPES:
            return RECIPES[key]
    close = difflib.get_close_matches(name, RECIPES, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"available: {', '.join(list_recipes())}"
    raise UnknownRecipeError(f"unknown recipe {name!r}; {hint} (`mbridge recipes` lists them all)")


__all__ = [
    "UnknownRecipeError",
    "gemma3_1b_lora_finetune_config",
    "gemma3_1b_pretrain_config",
    "gemma3_27b_lora_finetune_config",
    "gemma3_27b_pretrain_config",
    "gemma3_4b_lora_finetune_config",
    "gemma3_4b_pretrain_config",
    "get_recipe",
    "deepseek_v3_pretrain_config",
    "gpt_oss_120b_lora_finetune_config",
    "gpt_oss_120b_pretrain_config",
    "gpt_oss_20b_lora_finetune_config",
    "gpt_oss_20b_pretrain_config",
    "list_recipes",
    "llama2_7b_pretrain_config",
    "llama31_405b_pretrain_config",
    "llama3_70b_pretrain_config",
    "llama3_8b_finetune_config",
    "llama3_8b_lora_finetune_config",
    "llama3_8b_pretrain_config",
    "mistral_7b_pretrain_config",
    "mixtral_8x7b_pretrain_config",
    "moonlight_16b_pretrain_config",
    "olmo2_7b_lora_finetune_config",
    "olmo2_7b_pretrain_config",
    "phi3_mini_lora_finetune_config",
    "phi3_mini_pretrain_config",
    "qwen25_7b_pretrain_config",
    "qwen3_30b_a3b_pretrain_config",
    "qwen3_8b_finetune_config",
    "qwen3_8b_lora_finetune_config",
    "qwen3_8b_pretrain_config",
    "tiny_gpt_finetune_config",
    "tiny_gpt_lora_finetune_config",
    "tiny_gpt_pretrain_config",
]
