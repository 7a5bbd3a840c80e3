"""`mbridge finetune`: continue training from pretrained weights."""

from __future__ import annotations

from typing import Any

from megatron_bridge.cli import training


def register(subparsers: Any) -> None:
    training.add_parser(
        subparsers,
        "finetune",
        summary="fine-tune from a pretrained checkpoint (checkpoint.pretrained_checkpoint)",
        description="Fine-tune with megatron_bridge.training.finetune.finetune() and the standard GPT forward "
        "step, starting from the weights in checkpoint.pretrained_checkpoint. The fine-tuning recipes need "
        "two recipe options: --recipe-arg pretrained_checkpoint=CKPT_DIR --recipe-arg dataset_root=JSONL_DIR. "
        "Runs as a plain process or under torchrun.",
        tiny="tiny_gpt_finetune_config",
        gpu="llama3_8b_finetune_config",
        tiny_args=" \\\n      --recipe-arg pretrained_checkpoint=runs/tiny_gpt_pretrain/checkpoints --recipe-arg dataset_root=data/sft",
        gpu_args=" \\\n      --recipe-arg pretrained=/models/Meta-Llama-3-8B --recipe-arg dataset_root=/data/sft",
    )
