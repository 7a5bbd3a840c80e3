"""Which tokenizer a run uses: `TokenizerConfig`.

The public import path of `megatron_bridge.runtime.tokenizers.config`, where the class lives
(below the packages that build tokenizers)."""

from megatron_bridge.runtime.tokenizers.config import TOKENIZER_TYPES, TokenizerConfig

__all__ = ["TOKENIZER_TYPES", "TokenizerConfig"]
