"""Which tokenizer a run uses."""

from __future__ import annotations

from dataclasses import field
from typing import Literal, Optional

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems

TOKENIZER_TYPES = ("NullTokenizer", "HuggingFaceTokenizer")


@config_dataclass(kw_only=True)
class TokenizerConfig(ConfigBase):
    """Which tokenizer to build. Tokenizers are always loaded from local files, never the network."""

    tokenizer_type: Optional[Literal["NullTokenizer", "HuggingFaceTokenizer"]] = None
    """`NullTokenizer` (token ids are the data; needs `vocab_size`) or `HuggingFaceTokenizer`
    (loaded from `tokenizer_model`, a local directory or a `tokenizer.json` file)."""

    tokenizer_model: Optional[str] = None
    """Local directory or file of a Hugging Face tokenizer."""

    vocab_size: Optional[int] = None
    """Vocabulary size for `NullTokenizer` (its last id is the end-of-document token)."""

    vocab_extra_ids: int = 0
    """Number of extra sentinel tokens appended to the vocabulary."""

    special_tokens: Optional[list[str]] = None
    """Extra special tokens to register with a Hugging Face tokenizer."""

    chat_template: Optional[str] = None
    """Jinja chat template to set on a Hugging Face tokenizer (used by fine-tuning datasets)."""

    hf_tokenizer_kwargs: dict = field(default_factory=dict)
    """Keyword arguments passed to the Hugging Face tokenizer loader."""

    def _finalize(self, problems: Problems) -> None:
        if not problems.check(
            self.tokenizer_type is not None,
            "tokenizer_type",
            "is not set",
            f"set tokenizer.tokenizer_type to one of {list(TOKENIZER_TYPES)}",
        ):
            return
        if self.tokenizer_type == "NullTokenizer":
            problems.check(
                self.vocab_size is not None and self.vocab_size > 1,
                "vocab_size",
                f"NullTokenizer needs a vocabulary size above 1, got {self.vocab_size!r}",
                "set tokenizer.vocab_size, e.g. 32000",
            )
        if self.tokenizer_type == "HuggingFaceTokenizer":
            problems.check(
                bool(self.tokenizer_model),
                "tokenizer_model",
                "HuggingFaceTokenizer needs a local tokenizer directory or file",
                "set tokenizer.tokenizer_model to a path with tokenizer.json",
            )
        problems.check(
            self.vocab_extra_ids >= 0, "vocab_extra_ids", f"must be >= 0, got {self.vocab_extra_ids}", "use 0 or more"
        )
