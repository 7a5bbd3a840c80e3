"""Mistral and Mixtral recipes, laid out for 80 GB GPUs (H100)."""

from __future__ import annotations

from megatron_bridge.models import MistralModelProvider7B, MixtralModelProvider8x7B
from megatron_bridge.training.config import ConfigContainer
from recipes._base import pretrain_config, recipe
from recipes._options import PretrainOptions


@recipe(world_size=8, seq_length=4096)
def mistral_7b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Mistral 7B pretraining on 8 GPUs: data parallel only, 4096-token sequences."""
    return pretrain_config(MistralModelProvider7B(), opts)


@recipe(
    world_size=64,
    seq_length=4096,
    pipeline_model_parallel_size=4,
    virtual_pipeline_model_parallel_size=4,
    expert_model_parallel_size=8,
    lr=1e-4,
)
def mixtral_8x7b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Mixtral 8x7B pretraining on 64 GPUs: PP4 (4 virtual stages), 8-way expert parallel."""
    return pretrain_config(MixtralModelProvider8x7B(), opts)
