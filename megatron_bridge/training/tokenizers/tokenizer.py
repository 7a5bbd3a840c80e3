"""Tokenizers built from `TokenizerConfig`, with the interface megatron-core datasets use
(`vocab_size`, `eod`, `pad`, `tokenize`, `detokenize`, `unique_identifiers`)."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

from megatron_bridge.extras import require
from megatron_bridge.training.tokenizers.config import TokenizerConfig


class NullTokenizer:
    """Token ids are the data: "3 4 5" tokenizes to [3, 4, 5]. The last id is end-of-document."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1
        self.pad = -1  # megatron-core datasets mask the loss where labels equal `pad`
        self.bos = None

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(kind="NullTokenizer", vocab_size=self.vocab_size)


class HuggingFaceTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a local `tokenizer.json` (or a directory
    holding one); never downloads."""

    def __init__(self, path: str, special_tokens: Optional[list[str]] = None, extra_ids: int = 0):
        tokenizers = require("tokenizers", "tokenizer.tokenizer_type='HuggingFaceTokenizer'")
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"tokenizer.tokenizer_model: no tokenizer.json at {path!r} "
                "(point it at a directory with tokenizer.json or at the file itself)"
            )
        self.path = str(file)
        self._tok = tokenizers.Tokenizer.from_file(self.path)
        extra = list(special_tokens or []) + [f"<extra_id_{i}>" for i in range(extra_ids)]
        if extra:
            self._tok.add_special_tokens(extra)
        settings = _read_settings(file.parent)
        self.eod = self._id_of(settings.get("eos_token"), ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]"))
        if self.eod is None:
            raise ValueError(f"tokenizer at {path!r} has no end-of-sequence token (set eos_token in tokenizer_config.json)")
        pad = self._id_of(settings.get("pad_token"), ("<pad>", "[PAD]", "<|pad|>"))
        self.pad = pad if pad is not None else -1
        self.bos = self._id_of(settings.get("bos_token"), ("<s>", "<|begin_of_text|>", "[CLS]"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _id_of(self, preferred: Any, fallbacks: tuple[str, ...]) -> Optional[int]:
        if isinstance(preferred, dict):
            preferred = preferred.get("content")
        for token in ([preferred] if preferred else []) + list(fallbacks):
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(kind="HuggingFaceTokenizer", path=os.path.abspath(self.path), vocab_size=self.vocab_size)


def _read_settings(directory: Path) -> dict:
    settings = directory / "tokenizer_config.json"
    if settings.is_file():
        with open(settings) as f:
            return json.load(f)
    return {}


def build_tokenizer(cfg: TokenizerConfig):
    """The tokenizer `cfg` describes (finalized config assumed)."""
    if cfg.tokenizer_type == "NullTokenizer":
        return NullTokenizer(cfg.vocab_size + cfg.vocab_extra_ids)
    if cfg.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(cfg.tokenizer_model, cfg.special_tokens, cfg.vocab_extra_ids)
    raise ValueError(f"tokenizer.tokenizer_type: unsupported {cfg.tokenizer_type!r}")
