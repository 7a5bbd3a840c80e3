"""`mbridge pretrain`: train a model from a recipe or YAML config (also under torchrun)."""

from __future__ import annotations

from typing import Any

from megatron_bridge.cli import training


def register(subparsers: Any) -> None:
    training.add_parser(
        subparsers,
        "pretrain",
        summary="pretrain a model from a recipe or YAML config",
        description="Pretrain with megatron_bridge.training.pretrain.pretrain() and the standard GPT forward "
        "step. Runs as a plain process or under `torchrun -m megatron_bridge pretrain ...`.",
        tiny="tiny_gpt_pretrain_config",
        gpu="llama3_8b_pretrain_config",
    )
