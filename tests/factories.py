"""Small configs that tests build on (importable from any test module)."""

from __future__ import annotations

from megatron_bridge.models import GPTModelProvider
from megatron_bridge.training.config import (
    ConfigContainer,
    MockGPTDatasetConfig,
    OptimizerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron_bridge.training.tokenizers.config import TokenizerConfig


def tiny_model(**kw) -> GPTModelProvider:
    args = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        position_embedding_type="rope",
        transformer_impl="local",
    )
    args.update(kw)
    return GPTModelProvider(**args)


def tiny_config(**sections) -> ConfigContainer:
    """A valid single-process config of a tiny GPT on mock data; keyword args replace sections."""
    args = dict(
        train=TrainingConfig(train_iters=20, global_batch_size=8, micro_batch_size=2),
        model=tiny_model(),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4),
        dataset=MockGPTDatasetConfig(seq_length=32, num_workers=0),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=256),
        validation=ValidationConfig(eval_interval=10, eval_iters=2),
    )
    args.update(sections)
    return ConfigContainer(**args)
