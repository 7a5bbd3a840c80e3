"""The tokenizer of a model source, and the token ids that end a generation.

A Hugging Face directory brings its own tokenizer files; a checkpoint of ours names the tokenizer
its run used (run_config.yaml), and an imported one keeps the Hugging Face tokenizer in its
`hf/` assets, which is used when the recorded path is gone (the checkpoint was moved).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from megatron_bridge.inference.errors import SourceError
from megatron_bridge.inference.sources import ADAPTERS, HF, ModelSource, read_json, read_run_config
from megatron_bridge.runtime.tokenizers.config import SENTENCEPIECE_TYPES, TokenizerConfig
from megatron_bridge.runtime.tokenizers.tokenizer import HuggingFaceTokenizer, build_tokenizer

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _has_tokenizer_files(directory: Optional[str]) -> bool:
    return bool(directory) and any(os.path.isfile(os.path.join(directory, n)) for n in TOKENIZER_MARKERS)


def load_tokenizer(source: ModelSource, override: Optional[str] = None) -> Optional[Any]:
    """The tokenizer to use with `source` (`override`: a tokenizer directory or tokenizer.json
    given by the user); None when the source names none."""
    try:
        if override is not None:
            if not os.path.exists(override):
                raise SourceError(f"--tokenizer {override!r} does not exist")
            return HuggingFaceTokenizer(override)
        if source.kind == HF:
            return HuggingFaceTokenizer(source.directory) if _has_tokenizer_files(source.directory) else None
        tokenizer = _from_run_config(source)
        if tokenizer is None and source.kind == ADAPTERS:
            tokenizer = load_tokenizer(source.base)
        return tokenizer
    except (OSError, ValueError, ImportError) as exc:
        if isinstance(exc, SourceError):
            raise
        raise SourceError(f"the tokenizer of {source.describe()} does not load: {exc}") from None


def _from_run_config(source: ModelSource) -> Optional[Any]:
    saved = read_run_config(source.directory)
    kind = saved.value("tokenizer", "tokenizer_type")
    if kind == "HuggingFaceTokenizer":
        cfg = saved.build("tokenizer", TokenizerConfig)
        if cfg.tokenizer_model and not os.path.exists(cfg.tokenizer_model) and _has_tokenizer_files(source.hf_assets):
            cfg.tokenizer_model = source.hf_assets  # the checkpoint moved; its own copy of the files
        cfg.finalize()
        return build_tokenizer(cfg)
    if kind in ("GPT2BPETokenizer", *SENTENCEPIECE_TYPES):
        cfg = saved.build("tokenizer", TokenizerConfig)
        cfg.finalize()
        return build_tokenizer(cfg)
    if kind == "NullTokenizer":
        cfg = saved.build("tokenizer", TokenizerConfig)
        if cfg.vocab_size is None:
            cfg.vocab_size = saved.value("model", "vocab_size")
        cfg.finalize()
        return build_tokenizer(cfg)
    assets = source.hf_assets
    return HuggingFaceTokenizer(assets) if _has_tokenizer_files(assets) else None


def require_tokenizer(tokenizer: Optional[Any], source: ModelSource, why: str) -> Any:
    if tokenizer is None:
        raise SourceError(f"{source.describe()} has no tokenizer, which {why} needs (give one with --tokenizer DIR)")
    return tokenizer


def stop_token_ids(source: Optional[ModelSource], tokenizer: Any) -> frozenset[int]:
    """Ids that end a generation: the tokenizer's end-of-sequence token, and the `eos_token_id`
    of the model's generation_config.json (chat models list their end-of-turn tokens there)."""
    ids = set()
    if tokenizer is not None and getattr(tokenizer, "eod", None) is not None:
        ids.add(int(tokenizer.eod))
    assets = source.hf_assets if source is not None else None
    path = os.path.join(assets, "generation_config.json") if assets else None
    if path and os.path.isfile(path):
        try:
            value = read_json(path).get("eos_token_id")
        except SourceError:
            value = None
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not isinstance(item, bool):
                ids.add(item)
    return frozenset(ids)
