"""RMSNorm over a token's whole query or key projection (all heads together), as OLMo 2
normalizes queries and keys; megatron-core's `qk_layernorm` normalizes each head.

Used as the `q_layernorm` / `k_layernorm` submodule of megatron-core's attention, which calls it
on [sequence, batch, heads on this rank, head size]. Its weight covers the heads of this rank
(the rows of the Hugging Face `q_norm`/`k_norm` weight for those heads), split over
tensor-parallel ranks as the heads are. The mean square is over all heads: each rank's sum of
squares is summed over the tensor-parallel group (forward and backward), so TP gives the numbers
of one process. Every rank must hold whole, distinct key heads (num_query_groups a multiple of the
TP size): the provider checks it. Sequence parallelism does not reach inside attention.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose gradient is the all-reduced gradient: every rank's result feeds
    every rank's loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class ProjectionNorm(torch.nn.Module):
    """RMSNorm over the whole query (`which='query'`) or key (`which='key'`) projection."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, which: Literal["query", "key"] = "query",
                 tp_group: Optional[Any] = None):  # fmt: skip
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        heads = (
            config.num_attention_heads if which == "query" else (config.num_query_groups or config.num_attention_heads)
        )
        if tp_group is None and parallel_state.model_parallel_is_initialized():
            tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_group = tp_group
        self.tp_size = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        if heads % self.tp_size:
            raise ValueError(f"{heads} {which} heads do not split over {self.tp_size} tensor-parallel ranks")
        self.which = which
        self.head_size = hidden_size
        self.width = heads * hidden_size
        """Values each token is normalized over (all ranks)."""
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(heads // self.tp_size * hidden_size))
        set_tensor_model_parallel_attributes(self.weight, self.tp_size > 1, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads, size = x.shape[-2], x.shape[-1]
        if heads * size != self.weight.numel():
            raise ValueError(f"{self.which} norm over {self.weight.numel()} values got {heads} heads of {size}")
        dtype = x.dtype
        x = x.float()
        squares = x.pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.tp_size > 1:
            squares = _SumOverGroup.apply(squares, self.tp_group)
        normed = x * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight.view(heads, size) * normed).to(dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The weight as a tensor split along its one axis over tensor-parallel ranks."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.state_dict(prefix="", keep_vars=True)
        groups = {"tp_group": self.tp_group, "dp_cp_group": metadata["dp_cp_group"]}
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets, **groups)

    def extra_repr(self) -> str:
        return f"{self.which}, {self.weight.numel()} of {self.width}, eps={self.eps}"
