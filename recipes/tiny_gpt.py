"""Tiny GPT recipes: train in seconds on one CPU process (mock data or token-id JSONL)."""

from __future__ import annotations

from megatron_bridge.models import TinyGPTModelProvider
from megatron_bridge.training.config import ConfigContainer
from recipes._base import finetune_config, lora_finetune_config, pretrain_config, recipe
from recipes._options import FinetuneOptions, PretrainOptions

_CPU = dict(
    precision_config="fp32",
    use_distributed_optimizer=False,
    comm_overlap=False,
    global_batch_size=8,
    micro_batch_size=4,
    train_iters=200,
    lr_warmup_iters=10,
    log_interval=10,
    eval_interval=50,
    eval_iters=4,
    save_interval=None,
    num_workers=0,
)


@recipe(world_size=1, lr=3e-3, **_CPU)
def tiny_gpt_pretrain_config(opts: PretrainOptions) -> ConfigContainer:
    """Tiny GPT (3 layers, hidden 96, ~360k parameters) pretraining on mock data: one CPU process, fp32."""
    return pretrain_config(TinyGPTModelProvider(), opts)


@recipe(world_size=1, lr=1e-3, **_CPU)
def tiny_gpt_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """Tiny GPT fine-tuning on JSONL token ids from a pretrained checkpoint: one CPU process."""
    return finetune_config(TinyGPTModelProvider(), opts)


@recipe(world_size=1, lr=1e-3, **_CPU)
def tiny_gpt_lora_finetune_config(opts: FinetuneOptions) -> ConfigContainer:
    """Tiny GPT LoRA fine-tuning (rank 16, alpha 32) on JSONL token ids: one CPU process.

    Starts from a pretrained checkpoint; checkpoints hold only the adapters."""
    return lora_finetune_config(TinyGPTModelProvider(), opts)
