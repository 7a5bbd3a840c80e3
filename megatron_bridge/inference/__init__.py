"""Using a model: text generation (`generate`) and evaluation (`evaluate`: loss and perplexity
on a corpus, multiple-choice accuracy), on a Hugging Face directory or a checkpoint of ours.

Importing this package is cheap; torch and megatron-core load when a function is called.
"""

from __future__ import annotations

from typing import Any

__all__ = ["generate", "evaluate", "load_model", "InferenceModel", "Generation", "EvalResult"]

_HOMES = {
    "generate": "megatron_bridge.inference.generation",
    "Generation": "megatron_bridge.inference.generation",
    "evaluate": "megatron_bridge.inference.evaluation",
    "EvalResult": "megatron_bridge.inference.evaluation",
    "load_model": "megatron_bridge.inference.model",
    "InferenceModel": "megatron_bridge.inference.model",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
