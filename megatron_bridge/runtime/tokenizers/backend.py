"""Text to token ids and back for tokenizers held as a `tokenizers.Tokenizer` (`self._tok`):
what a Hugging Face tokenizer and GPT-2's BPE tokenizer share."""

from __future__ import annotations

from typing import Any


class TokenizersBacked:
    """Encoding and decoding through the `tokenizers.Tokenizer` in `_tok`."""

    _tok: Any

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        """The tokenizer's default encoding of `text`: with the special tokens its post-processor
        adds (a beginning-of-sequence token, for many), as `transformers`' `tokenizer(text)` gives."""
        return self._tok.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text; uses the tokenizer's own threads unless disabled
        (TOKENIZERS_PARALLELISM=false)."""
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and the (start, end) character span of each token in `text`."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
