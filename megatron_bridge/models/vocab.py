"""The model's vocabulary size when the config leaves it unset: that of the Hugging Face weights
a run starts from, else its tokenizer's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_bridge.config.errors import Problems
from megatron_bridge.models.hf.checks import pretrained_vocab_size
from megatron_bridge.runtime.tokenizers.tokenizer import local_vocab_size

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer


def null_tokenizer_vocab(cfg: "ConfigContainer") -> Optional[int]:
    """The vocabulary of a NullTokenizer of a given size, its extra ids included; None for other tokenizers."""
    tok = cfg.tokenizer
    if tok.tokenizer_type != "NullTokenizer" or tok.vocab_size is None:
        return None
    return tok.vocab_size + tok.vocab_extra_ids


def derive_vocab_size(cfg: "ConfigContainer", problems: Problems) -> None:
    """model.vocab_size, when unset, is that of the Hugging Face weights the run starts from;
    else the tokenizer's: a NullTokenizer's size (with its extra ids), or the size of a Hugging
    Face tokenizer whose files are on this machine."""
    if cfg.model.vocab_size is not None:
        return
    vocab = pretrained_vocab_size(cfg)
    if vocab is not None:  # the weights decide, not the tokenizer
        cfg.model._derive("vocab_size", vocab)
        return
    if problems.at("tokenizer"):
        return
    vocab = null_tokenizer_vocab(cfg)
    if vocab is not None:
        cfg.model._derive("vocab_size", vocab)
        return
    vocab = local_vocab_size(cfg.tokenizer)
    if vocab is not None:
        # Kept like a preset's value, not recomputed: a saved config must still build its model
        # where the tokenizer's files are gone (merging adapters, exporting weights).
        cfg.model.apply_default("vocab_size", vocab)
