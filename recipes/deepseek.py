"""DeepSeek-V3-architecture recipes, laid out for 80 GB GPUs (H100)."""

from __future__ import annotations

from megatron_bridge.models import DeepSeekV3ModelProvider, MoonlightModelProvider16B
from megatron_bridge.training.config import ConfigContainer
from recipes._base import pretrain_config, recipe
from recipes._options import PretrainOptions


@recipe(
    world_size=1024,
    seq_length=4096,
    tensor_model_parallel_size=2,
    pipeline_model_parallel_size=16,
    expert_model_parallel_size=64,
    expert_tensor_parallel_size=1,
    sequence_parallel=True,
    global_batch_size=4096,
    lr=2.2e-4,
)
def deepseek_v3_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """DeepSeek-V3 671B pretraining on 1024 GPUs: TP2 PP16, 64-way expert parallel, selective recompute.

    NVIDIA's layout for it: experts not TP-split, sequence parallel; 4 layers per pipeline stage
    (2 on the first, 3 on the last, which hold the embedding and the output layer); MLA's up
    projections, the norms and the MoE layers recomputed in backward."""
    model = DeepSeekV3ModelProvider(
        num_layers_in_first_pipeline_stage=2,
        num_layers_in_last_pipeline_stage=3,
        recompute_granularity="selective",
        recompute_modules=["mla_up_proj", "moe", "layernorm"],
    )
    return pretrain_config(model, opts)


@recipe(
    world_size=8,
    seq_length=4096,
    expert_model_parallel_size=8,
    expert_tensor_parallel_size=1,
    lr=4.2e-4,
)
def moonlight_16b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Moonlight 16B-A3B pretraining on 8 GPUs: 8-way expert parallel, data parallel otherwise."""
    return pretrain_config(MoonlightModelProvider16B(), opts)
