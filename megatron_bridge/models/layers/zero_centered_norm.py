"""RMSNorm whose weight is stored as an offset from one: `x / rms(x) * (1 + weight)`.

megatron-core calls this `layernorm_zero_centered_gamma`: TransformerEngine's norms implement it,
megatron-core's local torch norms refuse it. Gemma 2 and 3 store every norm weight this way, so
`ZeroCenteredRMSNorm` takes the place of the local RMSNorm when the field is set (input, pre-MLP,
query/key, output and final norms alike), and the Hugging Face weights load and export unchanged
(no `1 + w` conversion that could round them).

The arithmetic is Gemma's: normalize in fp32, multiply by `1 + weight` in fp32, cast the product
to the input dtype (a torch RMSNorm casts before the multiply).
"""

from __future__ import annotations

from typing import Any

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension with the weight stored as `gamma - 1` (zeros: identity).
    Built by megatron-core as its norms are: `(config=..., hidden_size=..., eps=...)`."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        # With sequence parallelism each rank normalizes its own tokens: megatron-core sums the
        # gradients of weights marked so over the tensor-parallel group.
        setattr(self.weight, "sequence_parallel", bool(getattr(config, "sequence_parallel", False)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, weight stored as gamma - 1"
