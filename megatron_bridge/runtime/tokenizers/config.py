"""Which tokenizer a run uses."""

from __future__ import annotations

from typing import Literal, Optional, get_args

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import COUNT, STEPS, Unsupported, field
from megatron_bridge.config.targets import register_target

TokenizerType = Literal[
    "NullTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "MultimodalTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
]
"""Every tokenizer type a config may name (Megatron-LM's); `REFUSED_TYPES` are not built here."""

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
"""Types read from a SentencePiece model file (`tokenizer_model`)."""

_TO_HF_DIR = "convert its files to a Hugging Face tokenizer directory (one with tokenizer.json) and set tokenizer.tokenizer_type=HuggingFaceTokenizer, tokenizer.tokenizer_model=DIR"

REFUSED_TYPES = {
    "TikTokenizer": f"{_TO_HF_DIR}: the model's Hugging Face release usually ships one; the tiktoken vocabulary itself is not read here",
    "BertWordPieceLowerCase": f"{_TO_HF_DIR}: e.g. transformers.BertTokenizerFast('vocab.txt', do_lower_case=True).save_pretrained(DIR)",
    "BertWordPieceCase": f"{_TO_HF_DIR}: e.g. transformers.BertTokenizerFast('vocab.txt', do_lower_case=False).save_pretrained(DIR)",
    "MultimodalTokenizer": "multimodal (image-tag) prompts are not built here: use tokenizer.tokenizer_type=HuggingFaceTokenizer for text",
    "NullMultimodalTokenizer": "multimodal models are not built here: use tokenizer.tokenizer_type=NullTokenizer for token-id data",
    "SFTTokenizer": "use tokenizer.tokenizer_type=HuggingFaceTokenizer with a chat template (tokenizer.chat_template) for chat fine-tuning",
}
"""Tokenizer types of configs written for Megatron-LM that are not built here, and what to use instead."""

TOKENIZER_TYPES = tuple(t for t in get_args(TokenizerType) if t not in REFUSED_TYPES)
"""The tokenizer types this runtime builds."""

TEXT_TOKENIZER_TYPES = tuple(t for t in TOKENIZER_TYPES if t != "NullTokenizer")
"""Types that read text (what `mbridge data preprocess --tokenizer-type` offers)."""

_TIKTOKEN_ONLY = Unsupported("read only by TikTokenizer, which is not supported here (use a HuggingFaceTokenizer directory instead)")
_MULTIMODAL_ONLY = Unsupported("read only by MultimodalTokenizer, which is not supported here")


@config_dataclass(kw_only=True)
class TokenizerConfig(ConfigBase):
    """Which tokenizer to build. Tokenizers are always loaded from local files, never the network."""

    tokenizer_type: Optional[TokenizerType] = None
    """`NullTokenizer` (token ids are the data; needs `vocab_size`), `HuggingFaceTokenizer`
    (loaded from `tokenizer_model`, a local directory or a `tokenizer.json` file) or
    `GPT2BPETokenizer` (GPT-2 byte-level BPE from `vocab_file` and `merge_file`), or one read
    from a SentencePiece `.model` in `tokenizer_model`: `SentencePieceTokenizer` (Megatron-LM's
    special tokens added), `GPTSentencePieceTokenizer`, `Llama2Tokenizer` (texts start with BOS).
    Megatron-LM's other types are refused with how to use their files through a
    `HuggingFaceTokenizer`."""

    tokenizer_model: Optional[str] = None
    """Local directory or file of a Hugging Face tokenizer, or the SentencePiece `.model` file of
    the SentencePiece types."""

    vocab_size: Optional[int] = field(None, range="[2, 2**31)")  # one token is no vocabulary
    """Vocabulary size for `NullTokenizer` (its last id is the end-of-document token)."""

    vocab_file: Optional[str] = None
    """GPT2BPETokenizer: local `vocab.json` of GPT-2's BPE (token -> id)."""

    merge_file: Optional[str] = None
    """GPT2BPETokenizer: local `merges.txt` of GPT-2's BPE (one merge per line)."""

    vocab_extra_ids: int = field(0, range=STEPS)
    """Number of extra sentinel tokens appended to the vocabulary."""

    special_tokens: Optional[list[str]] = None
    """Extra special tokens to register with a Hugging Face or GPT-2 BPE tokenizer."""

    chat_template: Optional[str] = None
    """Jinja chat template (or the path of a .jinja file) for chat fine-tuning data; overrides
    the tokenizer's own template."""

    hf_tokenizer_kwargs: Optional[dict] = field(default_factory=dict)
    """Options of the Hugging Face tokenizer: bos_token / eos_token / pad_token name its special
    tokens; other keys go to transformers.AutoTokenizer.from_pretrained (always offline)."""

    tiktoken_pattern: Optional[str] = field(None, status=_TIKTOKEN_ONLY)
    """TikTokenizer's pre-tokenization pattern ('v1' or 'v2')."""

    tiktoken_num_special_tokens: int = field(1000, range=COUNT, status=_TIKTOKEN_ONLY)
    """Number of ids TikTokenizer reserves for special tokens."""

    tiktoken_special_tokens: Optional[list[str]] = field(None, status=_TIKTOKEN_ONLY)
    """TikTokenizer's special tokens (needs '<unk>', '<s>', '</s>')."""

    tokenizer_prompt_format: Optional[str] = field(None, status=_MULTIMODAL_ONLY)
    """MultimodalTokenizer's prompt format."""

    image_tag_type: Optional[str] = field(None, status=_MULTIMODAL_ONLY)
    """MultimodalTokenizer's image tag type."""

    def _finalize(self, problems: Problems) -> None:
        if not problems.check(
            self.tokenizer_type is not None,
            "tokenizer_type",
            "is not set",
            f"set tokenizer.tokenizer_type to one of {list(TOKENIZER_TYPES)}",
        ):
            return
        if self.tokenizer_type in REFUSED_TYPES:
            problems.add("tokenizer_type", f"{self.tokenizer_type!r} is not supported here", REFUSED_TYPES[self.tokenizer_type])
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
        if self.tokenizer_type in SENTENCEPIECE_TYPES:
            self._check_sentencepiece(problems)
        if self.tokenizer_type == "GPT2BPETokenizer":
            for name, what in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")):
                problems.check(
                    bool(getattr(self, name)),
                    name,
                    f"GPT2BPETokenizer needs GPT-2's {what}, got {getattr(self, name)!r}",
                    f"set tokenizer.{name} to the local {what} of the BPE",
                )
        else:
            for name in ("vocab_file", "merge_file"):
                problems.check(
                    not getattr(self, name),
                    name,
                    f"only a GPT2BPETokenizer reads it (tokenizer_type={self.tokenizer_type!r})",
                    f"remove tokenizer.{name}, or set tokenizer.tokenizer_type=GPT2BPETokenizer",
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

    def _check_sentencepiece(self, problems: Problems) -> None:
        problems.check(
            bool(self.tokenizer_model),
            "tokenizer_model",
            f"{self.tokenizer_type} needs a SentencePiece model file",
            "set tokenizer.tokenizer_model to the local tokenizer.model",
        )
        problems.check(
            not self.special_tokens,
            "special_tokens",
            f"{self.tokenizer_type} adds no tokens given by name",
            "remove tokenizer.special_tokens, or convert the model to a HuggingFaceTokenizer directory",
        )
        if self.tokenizer_type != "SentencePieceTokenizer":
            problems.check(
                not self.vocab_extra_ids,
                "vocab_extra_ids",
                f"{self.tokenizer_type} adds no tokens to its model's vocabulary",
                "remove it, or use tokenizer_type=SentencePieceTokenizer (which appends <extra_id_N> sentinels)",
            )


# Its public import path (the API's, re-exported there): configs are written and read with it.
register_target(TokenizerConfig, "megatron_bridge.training.tokenizers.config.TokenizerConfig", canonical=True)
