"""OLMo 2 recipes, laid out for 80 GB GPUs (H100).

OLMo 2 is built on megatron-core's local layers (see `Olmo2ModelProvider`)."""

from __future__ import annotations

from megatron_bridge.models import Olmo2ModelProvider7B
from megatron_bridge.training.config import ConfigContainer
from recipes._base import FINETUNE_SCHEDULE, lora_finetune_config, pretrain_config, recipe
from recipes._options import FinetuneOptions, PretrainOptions


@recipe(world_size=8, seq_length=4096, tensor_model_parallel_size=2)
def olmo2_7b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """OLMo 2 7B pretraining on 8 GPUs: TP2, 4096-token sequences."""
    return pretrain_config(Olmo2ModelProvider7B(), opts)


@recipe(
    world_size=8,
    seq_length=4096,
    **FINETUNE_SCHEDULE,
)
def olmo2_7b_lora_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """OLMo 2 7B LoRA fine-tuning on 8 GPUs (data parallel): rank 16, alpha 32, all projections.

    The base weights stay frozen; checkpoints hold only the adapters."""
    return lora_finetune_config(Olmo2ModelProvider7B(), opts)
