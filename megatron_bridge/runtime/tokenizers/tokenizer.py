"""Tokenizers built from `TokenizerConfig`, with the interface megatron-core datasets use
(`vocab_size`, `eod`, `pad`, `tokenize`, `detokenize`, `unique_identifiers`), plus what the
data pipeline needs: batch encoding, character offsets, and the chat template."""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

from megatron_bridge.extras import require
from megatron_bridge.runtime.tokenizers.backend import TokenizersBacked
from megatron_bridge.runtime.tokenizers.config import TokenizerConfig
from megatron_bridge.runtime.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron_bridge.runtime.tokenizers.sentencepiece_tokenizers import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron_bridge.runtime import json_input

SPECIAL_TOKEN_KWARGS = ("bos_token", "eos_token", "pad_token")
"""`hf_tokenizer_kwargs` keys that name special tokens; honoured by both loaders."""


class NotTokenIdsError(ValueError):
    """Text given to a `NullTokenizer` that is not token ids of its vocabulary."""


def _is_token_id(word: str) -> bool:
    try:
        return int(word) >= 0
    except ValueError:
        return False


class NullTokenizer:
    """Token ids are the data: "3 4 5" tokenizes to [3, 4, 5]. The last id is end-of-document."""

    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1
        self.pad = -1  # megatron-core datasets mask the loss where labels equal `pad`
        self.bos = None

    def tokenize(self, text: str) -> list[int]:
        """The ids in `text`; `NotTokenIdsError` naming the first word that is not a whole number
        of at least 0 (ids past the vocabulary are for the caller to report: it knows the model's)."""
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            ids = None
        if ids is not None and all(i >= 0 for i in ids):
            return ids
        word = next(w for w in text.split() if not _is_token_id(w))
        shown = repr(word if len(word) <= 40 else word[:40] + "...")
        raise NotTokenIdsError(
            f"{shown} is not a token id: without a vocabulary (NullTokenizer), text is read as token ids from 0 to "
            f"{self.vocab_size - 1} separated by spaces (write it as ids, e.g. '3 4 5', or use a model with a tokenizer)"
        )

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def encode(self, text: str) -> list[int]:
        """The default encoding of `text`: its ids (there are no special tokens to add)."""
        return self.tokenize(text)

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(kind="NullTokenizer", vocab_size=self.vocab_size)


class HuggingFaceTokenizer(TokenizersBacked):
    """A Hugging Face tokenizer from local files only (never downloads): a `tokenizer.json`
    (or a directory holding one) is read with `tokenizers`; any other directory is loaded with
    `transformers.AutoTokenizer` offline, which must yield a fast tokenizer.

    `hf_kwargs`: `bos_token` / `eos_token` / `pad_token` override the special tokens; other keys
    go to `AutoTokenizer.from_pretrained` (and so select that loader). `chat_template` overrides
    the template of the tokenizer's files.
    """

    def __init__(
        self,
        path: str,
        special_tokens: Optional[list[str]] = None,
        extra_ids: int = 0,
        chat_template: Optional[str] = None,
        hf_kwargs: Optional[dict[str, Any]] = None,
    ):
        kwargs = dict(hf_kwargs or {})
        overrides = {k: kwargs.pop(k) for k in SPECIAL_TOKEN_KWARGS if k in kwargs}
        file = Path(path)
        directory = file if file.is_dir() else file.parent
        loaded: dict[str, Any] = {}
        if file.is_dir() and (file / "tokenizer.json").is_file() and not kwargs:
            file = file / "tokenizer.json"
        if file.is_file():
            tokenizers = require("tokenizers", "tokenizer.tokenizer_type='HuggingFaceTokenizer'")
            try:
                self._tok = tokenizers.Tokenizer.from_file(str(file))
            except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception for a file it cannot parse
                raise ValueError(f"tokenizer.tokenizer_model: {str(file)!r} is not a tokenizer the tokenizers library reads: {exc}") from None
            self.path = str(file)
        elif file.is_dir():
            self._tok, loaded = _load_with_transformers(str(file), kwargs)
            self.path = str(file)
        else:
            raise FileNotFoundError(
                f"tokenizer.tokenizer_model: nothing at {path!r} "
                "(point it at a directory with tokenizer.json, a tokenizer.json file, or a local "
                "directory that transformers.AutoTokenizer loads)"
            )
        extra = list(special_tokens or []) + [f"<extra_id_{i}>" for i in range(extra_ids)]
        if extra:
            self._tok.add_special_tokens(extra)
        settings = {**_read_settings(directory), **loaded, **overrides}
        self.eod = self._id_of(settings.get("eos_token"), ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]"))
        if self.eod is None:
            raise ValueError(
                f"tokenizer at {path!r} has no end-of-sequence token "
                "(set eos_token in tokenizer_config.json or tokenizer.hf_tokenizer_kwargs={eos_token: ...})"
            )
        pad = self._id_of(settings.get("pad_token"), ("<pad>", "[PAD]", "<|pad|>"))
        self.pad = pad if pad is not None else -1
        self.bos = self._id_of(settings.get("bos_token"), ("<s>", "<|begin_of_text|>", "[CLS]"))
        self.eos_token = self._tok.id_to_token(self.eod)
        self.bos_token = self._tok.id_to_token(self.bos) if self.bos is not None else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = _resolve_template(chat_template) if chat_template else _template_from_files(directory, settings)

    def _id_of(self, preferred: Any, fallbacks: tuple[str, ...]) -> Optional[int]:
        if isinstance(preferred, dict):
            preferred = preferred.get("content")
        for token in ([preferred] if preferred else []) + list(fallbacks):
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = OrderedDict(kind="HuggingFaceTokenizer", path=os.path.abspath(self.path), vocab_size=self.vocab_size)
        if self.chat_template:
            ids["chat_template"] = hashlib.sha256(self.chat_template.encode()).hexdigest()[:16]
        return ids


def _load_with_transformers(directory: str, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The `tokenizers` backend of the fast tokenizer `transformers.AutoTokenizer` builds from
    local files, and the special tokens and chat template it settled on."""
    transformers = require("transformers", "loading a tokenizer directory without tokenizer.json")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(directory, **{**kwargs, "local_files_only": True, "use_fast": True})
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"tokenizer.tokenizer_model: transformers cannot load {directory!r} offline ({exc})") from exc
    if not getattr(tok, "is_fast", False):
        raise ValueError(
            f"tokenizer.tokenizer_model: {directory!r} loads as a slow {type(tok).__name__}; a fast tokenizer is "
            "needed (save it with tokenizer.json, e.g. AutoTokenizer.from_pretrained(...).save_pretrained(dir))"
        )
    backend = tok.backend_tokenizer
    for name in ("bos_token", "eos_token", "pad_token"):  # tokens set by the Python class, not in tokenizer.json
        token = getattr(tok, name, None)
        if token and backend.token_to_id(token) is None:
            backend.add_special_tokens([token])
    settings = {n: getattr(tok, n, None) for n in ("bos_token", "eos_token", "pad_token", "chat_template")}
    return backend, {k: v for k, v in settings.items() if v}


def _read_settings(directory: Path) -> dict:
    settings = directory / "tokenizer_config.json"
    if settings.is_file():
        with open(settings, encoding="utf-8") as f:
            try:
                found = json_input.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{settings} is not valid JSON ({exc})") from None
        if not isinstance(found, dict):
            raise ValueError(f"{settings} holds no JSON object (a tokenizer's settings are one)")
        return found
    return {}


def _resolve_template(template: str) -> str:
    """A template given in the config: Jinja text, or the path of a `.jinja` file."""
    if template.endswith(".jinja") and "\n" not in template:
        path = Path(template)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.chat_template: no file {template!r}")
        return path.read_text()
    return template


def _template_from_files(directory: Path, settings: dict) -> Optional[str]:
    """The tokenizer's own chat template: `chat_template.jinja`, else tokenizer_config.json's
    `chat_template` (a string, or named templates of which 'default' is used)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


_LOADED: "OrderedDict[str, Any]" = OrderedDict()
"""The last few tokenizers loaded from files, by their settings and files' modification time:
validation reads the vocabulary size, and the run then uses the same tokenizer."""


def build_tokenizer(cfg: TokenizerConfig):
    """The tokenizer `cfg` describes (finalized config assumed)."""
    if cfg.tokenizer_type == "NullTokenizer":
        return NullTokenizer(cfg.vocab_size + cfg.vocab_extra_ids)
    if cfg.tokenizer_type == "GPT2BPETokenizer":
        args = (cfg.vocab_file, cfg.merge_file, cfg.special_tokens, cfg.vocab_extra_ids)
        return _loaded(GPT2BPETokenizer, args, (cfg.vocab_file, cfg.merge_file))
    if cfg.tokenizer_type == "SentencePieceTokenizer":
        return _loaded(SentencePieceTokenizer, (cfg.tokenizer_model, cfg.vocab_extra_ids), (cfg.tokenizer_model,))
    if cfg.tokenizer_type in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        cls = GPTSentencePieceTokenizer if cfg.tokenizer_type == "GPTSentencePieceTokenizer" else Llama2Tokenizer
        return _loaded(cls, (cfg.tokenizer_model,), (cfg.tokenizer_model,))
    if cfg.tokenizer_type != "HuggingFaceTokenizer":
        raise ValueError(f"tokenizer.tokenizer_type: unsupported {cfg.tokenizer_type!r}")
    args = (cfg.tokenizer_model, cfg.special_tokens, cfg.vocab_extra_ids, cfg.chat_template, cfg.hf_tokenizer_kwargs)
    return _loaded(HuggingFaceTokenizer, args, (cfg.tokenizer_model,))


def _loaded(cls: type, args: tuple, files: tuple) -> Any:
    """`cls(*args)`, reused while `files` are unchanged."""
    try:
        key = repr((cls.__name__, args, [_files_changed_at(f) for f in files]))
    except (OSError, TypeError):
        return cls(*args)  # reports the missing files
    if key not in _LOADED:
        _LOADED[key] = cls(*args)
        while len(_LOADED) > 4:
            _LOADED.popitem(last=False)
    return _LOADED[key]


def _files_changed_at(path: str) -> int:
    """When the tokenizer's files last changed: a directory's own time does not move when a file
    in it is rewritten, so the newest of its files counts."""
    times = [os.stat(path).st_mtime_ns]
    if os.path.isdir(path):
        times += [entry.stat().st_mtime_ns for entry in os.scandir(path) if entry.is_file()]
    return max(times)


def local_vocab_size(cfg: TokenizerConfig) -> Optional[int]:
    """The vocabulary size of a tokenizer read from files (Hugging Face, GPT-2 BPE, SentencePiece)
    that are on this machine; None when they are not (a dry run elsewhere) or do not load (the
    data checks report why)."""
    if cfg.tokenizer_type == "NullTokenizer":
        return None
    needed = [cfg.vocab_file, cfg.merge_file] if cfg.tokenizer_type == "GPT2BPETokenizer" else [cfg.tokenizer_model]
    if not all(f and os.path.exists(f) for f in needed):
        return None
    try:
        return build_tokenizer(cfg).vocab_size
    except (OSError, ValueError, ImportError):
        return None
