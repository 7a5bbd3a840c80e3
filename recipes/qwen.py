"""Qwen recipes, laid out for 80 GB GPUs (H100)."""

from __future__ import annotations

from megatron_bridge.models import Qwen3ModelProvider8B, Qwen3MoEModelProvider30B_A3B, Qwen25ModelProvider7B
from megatron_bridge.training.config import ConfigContainer
from recipes._base import FINETUNE_SCHEDULE, finetune_config, lora_finetune_config, pretrain_config, recipe
from recipes._options import FinetuneOptions, PretrainOptions


@recipe(world_size=8, seq_length=4096, tensor_model_parallel_size=2, sequence_parallel=True)
def qwen25_7b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Qwen2.5 7B pretraining on 8 GPUs: TP2, sequence parallel, 4096-token sequences."""
    return pretrain_config(Qwen25ModelProvider7B(), opts)


@recipe(world_size=8, seq_length=4096, tensor_model_parallel_size=2, sequence_parallel=True)
def qwen3_8b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Qwen3 8B pretraining on 8 GPUs: TP2, sequence parallel, 4096-token sequences."""
    return pretrain_config(Qwen3ModelProvider8B(), opts)


@recipe(
    world_size=32,
    seq_length=4096,
    tensor_model_parallel_size=4,
    pipeline_model_parallel_size=2,
    expert_model_parallel_size=4,
    expert_tensor_parallel_size=1,
    sequence_parallel=True,
)
def qwen3_30b_a3b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Qwen3 30B-A3B pretraining on 32 GPUs: TP4 PP2, 4-way expert parallel (experts not TP-split)."""
    return pretrain_config(Qwen3MoEModelProvider30B_A3B(), opts)


@recipe(
    world_size=8,
    seq_length=4096,
    tensor_model_parallel_size=2,
    sequence_parallel=True,
    **{**FINETUNE_SCHEDULE, "lr": 1e-5},  # every weight trains: a tenth of the adapters' peak LR
)
def qwen3_8b_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """Qwen3 8B full fine-tuning on 8 GPUs from a pretrained checkpoint: TP2, sequence parallel."""
    return finetune_config(Qwen3ModelProvider8B(), opts)


@recipe(
    world_size=8,
    seq_length=4096,
    **FINETUNE_SCHEDULE,
)
def qwen3_8b_lora_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """Qwen3 8B LoRA fine-tuning on 8 GPUs (data parallel): rank 16, alpha 32, all projections.

    The base weights stay frozen; checkpoints hold only the adapters."""
    return lora_finetune_config(Qwen3ModelProvider8B(), opts)
