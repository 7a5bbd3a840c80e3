"""megatron_bridge: typed, validated configs and training entry points for megatron-core.

Heavy modules load on first use: `import megatron_bridge` is cheap.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__version__ = "0.1.0"

# megatron-core warns at import that it falls back to torch implementations when neither
# TransformerEngine nor Apex is installed: expected on CPU, and said once by our own setup log.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
warnings.filterwarnings("ignore", message="Apex is not installed. Falling back to Torch Norm", category=UserWarning)
# ...and finalizing any TransformerConfig warns about its own default cuda_graph_scope.
warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)

_LAZY = {
    "ConfigContainer": "megatron_bridge.training.config",
    "pretrain": "megatron_bridge.training.pretrain",
    "finetune": "megatron_bridge.training.finetune",
}

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
