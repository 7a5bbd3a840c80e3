"""Llama recipes, laid out for 80 GB GPUs (H100)."""

from __future__ import annotations

from megatron_bridge.models import (
    Llama2ModelProvider7B,
    Llama3ModelProvider8B,
    Llama3ModelProvider70B,
    Llama31ModelProvider405B,
)
from megatron_bridge.training.config import ConfigContainer
from recipes._base import FINETUNE_SCHEDULE, finetune_config, lora_finetune_config, pretrain_config, recipe
from recipes._options import FinetuneOptions, PretrainOptions


@recipe(world_size=8, seq_length=4096)
def llama2_7b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Llama 2 7B pretraining on 8 GPUs: data parallel only, 4096-token sequences."""
    return pretrain_config(Llama2ModelProvider7B(), opts)


@recipe(world_size=8, seq_length=8192, context_parallel_size=2)
def llama3_8b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Llama 3 8B pretraining on 8 GPUs: CP2 for 8192-token sequences."""
    return pretrain_config(Llama3ModelProvider8B(), opts)


@recipe(
    world_size=64,
    seq_length=8192,
    tensor_model_parallel_size=4,
    pipeline_model_parallel_size=4,
    virtual_pipeline_model_parallel_size=5,
    context_parallel_size=2,
    sequence_parallel=True,
    tp_comm_overlap=True,
    lr=1.5e-4,
)
def llama3_70b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Llama 3 70B pretraining on 64 GPUs: TP4 PP4 (5 virtual stages) CP2, sequence parallel."""
    return pretrain_config(Llama3ModelProvider70B(), opts)


@recipe(
    world_size=1024,
    seq_length=8192,
    tensor_model_parallel_size=8,
    pipeline_model_parallel_size=8,
    virtual_pipeline_model_parallel_size=8,
    context_parallel_size=2,
    sequence_parallel=True,
    tp_comm_overlap=True,
    global_batch_size=2048,
    lr=8e-5,
    min_lr=8e-7,
    lr_warmup_iters=8000,
)
def llama31_405b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Llama 3.1 405B pretraining on 1024 GPUs: TP8 PP8 (8 virtual stages) CP2, sequence parallel."""
    # 126 layers + embedding + loss = 128 pipeline slots: 2 per virtual stage.
    model = Llama31ModelProvider405B(
        account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True
    )
    return pretrain_config(model, opts)


@recipe(
    world_size=8,
    seq_length=4096,
    tensor_model_parallel_size=2,
    sequence_parallel=True,
    **{**FINETUNE_SCHEDULE, "lr": 1e-5},  # every weight trains: a tenth of the adapters' peak LR
)
def llama3_8b_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """Llama 3 8B full fine-tuning on 8 GPUs from a pretrained checkpoint: TP2, sequence parallel."""
    return finetune_config(Llama3ModelProvider8B(), opts)


@recipe(
    world_size=8,
    seq_length=4096,
    **FINETUNE_SCHEDULE,
)
def llama3_8b_lora_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """Llama 3 8B LoRA fine-tuning on 8 GPUs (data parallel): rank 16, alpha 32, all projections.

    The base weights stay frozen; checkpoints hold only the adapters."""
    return lora_finetune_config(Llama3ModelProvider8B(), opts)
