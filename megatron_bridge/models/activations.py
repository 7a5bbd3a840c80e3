"""Activation functions that megatron-core has only as compiled kernels.

megatron-core's `quick_gelu` is wrapped in `torch.compile`, which compiles it on its first call
and again for new shapes (the token count of each expert changes every step): tens of seconds on
a CPU. The functions here compute the same values in eager mode. Configs name them by their full
path (`megatron_bridge.models.activations.quick_gelu`).
"""

from __future__ import annotations

import torch

from megatron_bridge.config.targets import register_target


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): GELU's sigmoid approximation, as megatron-core's `quick_gelu`
    computes it (the gate of GPT-OSS's clamped SwiGLU)."""
    return x * torch.sigmoid(1.702 * x)


register_target(quick_gelu)  # configs may name it
