"""Phi-3 recipes, laid out for 80 GB GPUs (H100)."""

from __future__ import annotations

from megatron_bridge.models import Phi3ModelProviderMini
from megatron_bridge.training.config import ConfigContainer
from recipes._base import FINETUNE_SCHEDULE, lora_finetune_config, pretrain_config, recipe
from recipes._options import FinetuneOptions, PretrainOptions


@recipe(world_size=8, seq_length=4096)
def phi3_mini_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Phi-3 mini (4k context) pretraining on 8 GPUs: data parallel only, 4096-token sequences."""
    return pretrain_config(Phi3ModelProviderMini(), opts)


@recipe(
    world_size=8,
    seq_length=4096,
    **FINETUNE_SCHEDULE,
)
def phi3_mini_lora_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """Phi-3 mini LoRA fine-tuning on 8 GPUs (data parallel): rank 16, alpha 32, all projections.

    The base weights stay frozen; checkpoints hold only the adapters."""
    return lora_finetune_config(Phi3ModelProviderMini(), opts)
