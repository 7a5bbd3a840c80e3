"""GPT-OSS recipes, laid out for 80 GB GPUs (H100).

Pretraining uses TransformerEngine layers (its attention has learned sinks, its grouped expert
GEMM has biases); LoRA uses megatron-core's local layers, as adapters do, with sequential
experts."""

from __future__ import annotations

from megatron_bridge.models import GptOssModelProvider20B, GptOssModelProvider120B
from megatron_bridge.peft import LoRA
from megatron_bridge.training.config import ConfigContainer
from recipes._base import FINETUNE_SCHEDULE, lora_finetune_config, pretrain_config, recipe
from recipes._options import FinetuneOptions, PretrainOptions

ATTENTION_LORA = ["linear_qkv", "linear_proj"]
"""The projections whose adapters the peft format (and serving tools) take for GPT-OSS: the
attention's; its experts are stacked 3-D tensors, not linear modules."""


@recipe(world_size=8, seq_length=4096, expert_model_parallel_size=8)
def gpt_oss_20b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """gpt-oss-20b pretraining on 8 GPUs: 8-way expert parallel, 4096-token sequences.

    Each GPU holds 4 of every layer's 32 experts."""
    return pretrain_config(GptOssModelProvider20B(), opts)


@recipe(world_size=64, seq_length=4096, pipeline_model_parallel_size=4, expert_model_parallel_size=16)
def gpt_oss_120b_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """gpt-oss-120b pretraining on 64 GPUs: PP4, 16-way expert parallel, 4096-token sequences.

    Each pipeline stage holds 9 layers, each GPU 8 of every layer's 128 experts."""
    return pretrain_config(GptOssModelProvider120B(), opts)


LORA_DEFAULTS = dict(seq_length=4096, expert_model_parallel_size=8, **FINETUNE_SCHEDULE)


def _lora(model, opts: FinetuneOptions) -> ConfigContainer:
    """LoRA on the attention projections of local layers: sequential experts (adapters wrap
    megatron-core's local linear layers), the unfused attention's score matrices recomputed in
    the backward pass instead of kept (it is the core attention that has sinks)."""
    model.moe_grouped_gemm = False
    model.recompute_granularity = "selective"
    model.recompute_modules = ["core_attn"]
    return lora_finetune_config(model, opts, LoRA(dim=16, alpha=32, target_modules=list(ATTENTION_LORA)))


@recipe(world_size=8, **LORA_DEFAULTS)
def gpt_oss_20b_lora_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """gpt-oss-20b LoRA fine-tuning on 8 GPUs: rank 16, alpha 32 on the attention, EP8.

    The base weights stay frozen; checkpoints hold only the adapters, which `mbridge peft export`
    writes in the peft format."""
    return _lora(GptOssModelProvider20B(), opts)


@recipe(world_size=8, **LORA_DEFAULTS)
def gpt_oss_120b_lora_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """gpt-oss-120b LoRA fine-tuning on 8 GPUs: rank 16, alpha 32 on the attention, EP8.

    Each GPU holds 16 of every layer's 128 experts. The base weights stay frozen; checkpoints hold
    only the adapters, which `mbridge peft export` writes in the peft format."""
    return _lora(GptOssModelProvider120B(), opts)
