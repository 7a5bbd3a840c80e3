"""Gemma 3 recipes (text decoder), laid out for 80 GB GPUs (H100).

Gemma 3 is built on megatron-core's local layers (see `Gemma3ModelProvider`), so sequence
parallelism is not used; the 262k-row vocabulary makes the output layer and its fp32 logits a
large part of each stage's memory."""

from __future__ import annotations

from megatron_bridge.models import Gemma3ModelProvider1B, Gemma3ModelProvider4B, Gemma3ModelProvider27B
from megatron_bridge.training.config import ConfigContainer
from recipes._base import FINETUNE_SCHEDULE, lora_finetune_config, pretrain_config, recipe
from recipes._options import FinetuneOptions, PretrainOptions


@recipe(world_size=8, seq_length=8192)
def gemma3_1b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Gemma 3 1B pretraining on 8 GPUs: data parallel only, 8192-token sequences."""
    return pretrain_config(Gemma3ModelProvider1B(), opts)


@recipe(world_size=8, seq_length=8192, tensor_model_parallel_size=2)
def gemma3_4b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Gemma 3 4B (text) pretraining on 8 GPUs: TP2, 8192-token sequences."""
    return pretrain_config(Gemma3ModelProvider4B(), opts)


@recipe(world_size=64, seq_length=8192, tensor_model_parallel_size=8, pipeline_model_parallel_size=4)
def gemma3_27b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Gemma 3 27B (text) pretraining on 64 GPUs: TP8 PP4, 8192-token sequences."""
    # 62 layers + embedding + loss = 64 pipeline slots: 16 per stage.
    model = Gemma3ModelProvider27B(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    return pretrain_config(model, opts)


@recipe(world_size=8, seq_length=8192, **FINETUNE_SCHEDULE)
def gemma3_1b_lora_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """Gemma 3 1B LoRA fine-tuning on 8 GPUs (data parallel): rank 16, alpha 32, all projections.

    The base weights stay frozen; checkpoints hold only the adapters."""
    return lora_finetune_config(Gemma3ModelProvider1B(), opts)


@recipe(world_size=8, seq_length=8192, **FINETUNE_SCHEDULE)
def gemma3_4b_lora_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """Gemma 3 4B (text) LoRA fine-tuning on 8 GPUs (data parallel): rank 16, alpha 32.

    Adapters on all four projections; the base weights stay frozen; checkpoints hold only the
    adapters."""
    return lora_finetune_config(Gemma3ModelProvider4B(), opts)


@recipe(world_size=8, seq_length=8192, tensor_model_parallel_size=8, **FINETUNE_SCHEDULE)
def gemma3_27b_lora_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """Gemma 3 27B (text) LoRA fine-tuning on 8 GPUs: TP8, rank 16, alpha 32, all projections.

    The base weights stay frozen; checkpoints hold only the adapters. TP8 rather than TP4 PP2:
    the first of two stages holds two micro batches of 8192-token activations in the 1F1B
    warm-up and does not fit 80 GB."""
    return lora_finetune_config(Gemma3ModelProvider27B(), opts)
