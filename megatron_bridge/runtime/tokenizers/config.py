"""Which tokenizer a run uses."""

from __future__ import annotations

from typing import Literal, Optional

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import STEPS, field
from megatron_bridge.config.targets import register_target

TOKENIZER_TYPES = ("NullTokenizer", "HuggingFaceTokenizer")


@config_dataclass(kw_only=True)
class TokenizerConfig(ConfigBase):
    """Which tokenizer to build. Tokenizers are always loaded from local files, never the network."""

    tokenizer_type: Optional[Literal["NullTokenizer", "HuggingFaceTokenizer"]] = None
    """`NullTokenizer` (token ids are the data; needs `vocab_size`) or `HuggingFaceTokenizer`
    (loaded from `tokenizer_model`, a local directory or a `tokenizer.json` file)."""

    tokenizer_model: Optional[str] = None
    """Local directory or file of a Hugging Face tokenizer."""

    vocab_size: Optional[int] = field(None, range="[2, 2**31)")  # one token is no vocabulary
    """Vocabulary size for `NullTokenizer` (its last id is the end-of-document token)."""

    vocab_extra_ids: int = field(0, range=STEPS)
    """Number of extra sentinel tokens appended to the vocabulary."""

    special_tokens: Optional[list[str]] = None
    """Extra special tokens to register with a Hugging Face tokenizer."""

    chat_template: Optional[str] = None
    """Jinja chat template (or the path of a .jinja file) for chat fine-tuning data; overrides
    the tokenizer's own template."""

    hf_tokenizer_kwargs: dict = field(default_factory=dict)
    """Options of the Hugging Face tokenizer: bos_token / eos_token / pad_token name its special
    tokens; other keys go to transformers.AutoTokenizer.from_pretrained (always offline)."""

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
        if self.tokenizer_type != "HuggingFaceTokenizer":
            for name in ("chat_template", "hf_tokenizer_kwargs"):
                problems.check(
                    not getattr(self, name),
                    name,
                    f"only a HuggingFaceTokenizer reads it (tokenizer_type={self.tokenizer_type!r})",
                    f"remove tokenizer.{name} or use a HuggingFaceTokenizer",
                )
        kwargs = self.hf_tokenizer_kwargs or {}
        problems.check(
            not kwargs.get("trust_remote_code"),
            "hf_tokenizer_kwargs.trust_remote_code",
            "a config cannot run code from a tokenizer directory",
            "use a tokenizer that loads without remote code (one with tokenizer.json)",
        )
        for name in ("bos_token", "eos_token", "pad_token"):
            value = kwargs.get(name)
            problems.check(
                value is None or (isinstance(value, str) and value),
                f"hf_tokenizer_kwargs.{name}",
                f"must be the text of a token, got {value!r}",
                "e.g. '</s>'",
            )
        problems.check(
            self.vocab_extra_ids >= 0, "vocab_extra_ids", f"must be >= 0, got {self.vocab_extra_ids}", "use 0 or more"
        )


# Its public import path (the API's, re-exported there): configs are written and read with it.
register_target(TokenizerConfig, "megatron_bridge.training.tokenizers.config.TokenizerConfig", canonical=True)
