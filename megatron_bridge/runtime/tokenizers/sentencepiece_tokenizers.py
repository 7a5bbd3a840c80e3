"""Tokenizers over a SentencePiece model file (`tokenizer.model`), as Megatron-LM defines them:

* `SentencePieceTokenizer`: the model's pieces, then special tokens it lacks (`<CLS>`, `<SEP>`,
  `<EOD>`, `<MASK>`, the pad/bos/eos tokens) and `<extra_id_N>` sentinels; special tokens in text
  are kept whole; `<EOD>` ends a document.
* `GPTSentencePieceTokenizer`: the model's pieces only; its end-of-sequence token ends a document.
* `Llama2Tokenizer`: as the GPT one, and every text starts with the beginning-of-sequence token.

Errors name the config field (`tokenizer.tokenizer_model: ...`)."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

from megatron_bridge.extras import require


def _load(model_file: str, kind: str) -> Any:
    spm = require("sentencepiece", f"tokenizer.tokenizer_type='{kind}'")
    if not os.path.exists(model_file):
        raise FileNotFoundError(f"tokenizer.tokenizer_model: {model_file!r} does not exist")
    if not os.path.isfile(model_file):
        raise OSError(f"tokenizer.tokenizer_model: {model_file!r} is not a file (a {kind} reads a SentencePiece .model file)")
    try:
        with open(model_file, "rb") as f:
            proto = f.read()
    except OSError as exc:
        raise OSError(f"tokenizer.tokenizer_model: cannot read {model_file!r} ({exc.strerror})") from None
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(proto)
    except (RuntimeError, OSError, TypeError):
        raise ValueError(f"tokenizer.tokenizer_model: {model_file!r} is not a SentencePiece model (it does not parse as one)") from None
    return processor


def _id_or_none(value: int) -> Any:
    return value if value >= 0 else None


class GPTSentencePieceTokenizer:
    """The pieces of a SentencePiece model; its end-of-sequence token is the end-of-document."""

    chat_template = None
    kind = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: str):
        self.model_file = model_file
        self._sp = _load(model_file, self.kind)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = _id_or_none(self._sp.eos_id())
        if self.eod is None:
            raise ValueError(f"tokenizer.tokenizer_model: {model_file!r} has no end-of-sequence piece (trained with eos_id=-1)")
        self.bos = _id_or_none(self._sp.bos_id())
        pad = self._sp.pad_id()
        self.pad = pad if pad >= 0 else -1  # megatron-core datasets mask the loss where labels equal `pad`
        self.eos_token = self._sp.id_to_piece(self.eod)
        self.bos_token = self._sp.id_to_piece(self.bos) if self.bos is not None else None

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode(self, text: str) -> list[int]:
        return self.tokenize(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(kind=self.kind, path=os.path.abspath(self.model_file), vocab_size=self.vocab_size)


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama 2's SentencePiece tokenizer: every text starts with the beginning-of-sequence token."""

    kind = "Llama2Tokenizer"

    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self.bos is None:
            raise ValueError(f"tokenizer.tokenizer_model: {model_file!r} has no beginning-of-sequence piece, which Llama2Tokenizer starts texts with")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *self._sp.encode(text)]


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """A SentencePiece model with Megatron-LM's special tokens added after its pieces (those it
    lacks) and `extra_ids` sentinels; special tokens in text are kept whole."""

    kind = "SentencePieceTokenizer"

    def __init__(self, model_file: str, extra_ids: int = 0):
        self.model_file = model_file
        self._sp = sp = _load(model_file, self.kind)
        pieces = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        self._special: dict[str, int] = {}  # in Megatron-LM's order: it decides ties in `tokenize`

        def add(token: str) -> int:
            if token not in pieces:
                pieces[token] = len(pieces)
            self._special[token] = pieces[token]
            return pieces[token]

        def piece_or(piece_id: int, fallback: str) -> str:
            return sp.id_to_piece(piece_id) if 0 <= piece_id < sp.get_piece_size() else fallback

        for token in ("<CLS>", "<SEP>"):
            add(token)
        self.eod = add("<EOD>")
        add("<MASK>")
        self.pad = add(piece_or(sp.pad_id(), "<PAD>"))
        self.bos_token = piece_or(sp.bos_id(), "<BOS>")
        self.bos = add(self.bos_token)
        self.eos_token = "<EOD>"
        add(piece_or(sp.eos_id(), "<EOS>"))
        for i in range(extra_ids):
            add(f"<extra_id_{i}>")
        self._special_of_id = {i: t for t, i in self._special.items()}
        self.vocab_size = len(pieces)

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        while True:
            found = {t: text.find(t, start) for t in self._special}
            found = {t: at for t, at in found.items() if at >= 0}
            if not found:
                break
            token = min(found, key=found.get)  # the earliest; the first of equals in Megatron-LM's order
            ids += self._sp.encode(text[start : found[token]])
            ids.append(self._special[token])
            start = found[token] + len(token)
        return ids + self._sp.encode(text[start:])

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        parts, run = [], []
        for i in (int(x) for x in ids):
            if i in self._special_of_id:
                parts += [self._sp.decode(run) + " ", self._special_of_id[i] + " "]
                run = []
            else:
                run.append(i)
        return "".join(parts) + self._sp.decode(run)
