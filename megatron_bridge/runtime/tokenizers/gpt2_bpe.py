"""GPT-2's byte-level BPE tokenizer from its two files, as Megatron-LM's `GPT2BPETokenizer`
reads them: `vocab.json` (token -> id) and `merges.txt` (one merge per line, ranked by order).

Text is split with GPT-2's pattern, each piece's UTF-8 bytes are mapped to printable characters,
and the merges join them; `<|endoftext|>` is the end-of-document token (and is never split when it
appears in text, as in `transformers`' GPT-2 tokenizer). Loaded with `tokenizers`, offline.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any, Optional

from megatron_bridge.extras import require
from megatron_bridge.runtime.tokenizers.backend import TokenizersBacked

EOD_TOKEN = "<|endoftext|>"
"""GPT-2's end-of-document token; added to the vocabulary when `vocab.json` lacks it."""


class GPT2BPETokenizer(TokenizersBacked):
    """GPT-2 byte-level BPE from local `vocab_file` and `merge_file`. `special_tokens` and
    `extra_ids` sentinels (`<extra_id_N>`) are added after the vocabulary's own tokens.

    Errors name the config field of the file at fault (`tokenizer.vocab_file: ...`)."""

    chat_template = None

    def __init__(self, vocab_file: str, merge_file: str, special_tokens: Optional[list[str]] = None, extra_ids: int = 0):
        tokenizers = require("tokenizers", "tokenizer.tokenizer_type='GPT2BPETokenizer'")
        vocab = read_vocab(vocab_file)
        merges = read_merges(merge_file)
        unknown = next(((a, b) for a, b in merges if a not in vocab or b not in vocab or a + b not in vocab), None)
        if unknown is not None:
            raise ValueError(
                f"tokenizer.merge_file: the merge {' '.join(unknown)!r} of {merge_file!r} joins tokens that "
                f"{vocab_file!r} lacks (the two files are of different tokenizers)"
            )
        model = tokenizers.models.BPE(
            vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
        )
        tok = tokenizers.Tokenizer(model)
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        tok.add_special_tokens([EOD_TOKEN, *(special_tokens or []), *(f"<extra_id_{i}>" for i in range(extra_ids))])
        self._tok = tok
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self.eod = tok.token_to_id(EOD_TOKEN)
        self.eos_token = EOD_TOKEN
        self.bos, self.bos_token = None, None  # GPT-2 documents are separated by end-of-document only
        self.pad = -1  # megatron-core datasets mask the loss where labels equal `pad`
        # ids need not be dense: the embedding must reach the largest one
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            kind="GPT2BPETokenizer",
            vocab_file=os.path.abspath(self.vocab_file),
            merge_file=os.path.abspath(self.merge_file),
            vocab_size=self.vocab_size,
        )


def _read_text(path: str, field_name: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer.{field_name}: {path!r} does not exist") from None
    except IsADirectoryError:
        raise OSError(f"tokenizer.{field_name}: {path!r} is a directory, not a file") from None
    except OSError as exc:
        raise OSError(f"tokenizer.{field_name}: cannot read {path!r} ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"tokenizer.{field_name}: {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_vocab(path: str) -> dict[str, int]:
    """The token -> id map of a GPT-2 `vocab.json`."""
    try:
        vocab: Any = json.loads(_read_text(path, "vocab_file"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"tokenizer.vocab_file: {path!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"tokenizer.vocab_file: {path!r} holds no JSON object of tokens and their ids (GPT-2's vocab.json is one)")
    bad = next(((t, i) for t, i in vocab.items() if isinstance(i, bool) or not isinstance(i, int) or i < 0), None)
    if bad is not None:
        raise ValueError(f"tokenizer.vocab_file: {path!r} gives token {bad[0]!r} the id {bad[1]!r} (ids are whole numbers from 0)")
    if len(set(vocab.values())) != len(vocab):
        raise ValueError(f"tokenizer.vocab_file: {path!r} gives two tokens the same id")
    return vocab


def read_merges(path: str) -> list[tuple[str, str]]:
    """The merges of a GPT-2 `merges.txt`, highest priority first (a `#version` line is skipped)."""
    merges = []
    for number, line in enumerate(_read_text(path, "merge_file").split("\n"), start=1):
        line = line.removesuffix("\r")  # not splitlines(): it would also break at characters tokens may hold
        if not line.strip() or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"tokenizer.merge_file: line {number} of {path!r} is {line[:60]!r}, not two tokens separated by a space")
        merges.append((parts[0], parts[1]))
    return merges
