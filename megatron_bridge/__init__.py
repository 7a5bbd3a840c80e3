"""megatron_bridge: typed, validated configs and training entry points for megatron-core.

Heavy modules load on first use: `import megatron_bridge` is cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_bridge.config.targets import register_lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "ConfigContainer": "megatron_bridge.training.config",
    "pretrain": "megatron_bridge.training.pretrain",
    "finetune": "megatron_bridge.training.finetune",
}

register_lazy_exports("megatron_bridge", {"ConfigContainer": _LAZY["ConfigContainer"]})  # configs name it so

__all__ = ["ConfigContainer", "pretrain", "finetune", "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_bridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
