"""Adapters around megatron-core's tensor-parallel linear layers.

`AdaptedLinear` replaces a `ColumnParallelLinear` or `RowParallelLinear` (also inside MoE experts)
in its parent module. It keeps the base layer and calls it unchanged; it adds the low-rank path

    y = base(x) + scale * B @ A @ x                                   (LoRA)
    y = m / ||W + scale * B @ A||_row * (W x + scale * B @ A @ x) + b   (DoRA, norm not differentiated)

with the parallel layout of the base layer:

* column-parallel (output split over TP): A [r, in] is replicated, B [out/tp, r] is split along
  the output like W. Each rank computes A x for the whole input, so dL/d(Ax) is summed over TP
  (one all-reduce of r channels). With sequence parallelism the base layer gathers its
  sequence-split input; the adapter applies A to its own sequence chunk and gathers the r-channel
  result instead (cheaper), and the gradient of A, then partial over the sequence, is summed over
  TP with the layer norms' (`sequence_parallel` attribute).
* row-parallel (input split over TP): A [r, in/tp] is split along the input like W, B [out, r]
  is replicated. A x is a partial sum that is all-reduced (r channels) before B; with sequence
  parallelism it is reduce-scattered over the sequence instead, as the base output is, and B's
  gradient is summed over TP like the layer norms'.

The base layer's parameters are registered on the adapter under their own names, so the
state-dict keys of the base weights do not change: a pretrained checkpoint loads into an adapted
model, and `unwrap()` puts the plain layer back.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron_bridge.runtime.checkpointing.weights import ADAPTER_PARAMS


class AdaptedLinear(torch.nn.Module):
    """A megatron-core parallel linear layer with a LoRA or DoRA adapter (see the module docstring)."""

    def __init__(self, base: torch.nn.Module, kind: str, dim: int, scale: float, dropout: float,
                 dropout_position: str, dora: bool, glu_fc1: bool):  # fmt: skip
        super().__init__()
        for name, param in base.named_parameters(recurse=False):
            self.register_parameter(name, param)
        object.__setattr__(self, "base_layer", base)  # not a child module: its parameters are ours
        self.kind = kind
        self.dim = dim
        self.scale = scale
        self.dropout_p = dropout
        self.dropout_position = dropout_position
        self.dora = dora
        self.glu_fc1 = glu_fc1
        """A gated MLP's first projection: its output rows are [gate; up] per rank (checkpoints
        store them as all gates, then all ups)."""
        self.merged = False

        tp = base.tp_group.size()
        self.tp_size = tp
        # Inside experts the token dispatcher does the communication; the expert layers do none.
        self.explicit_comm = bool(getattr(base, "explicit_expert_comm", False))
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and not self.explicit_comm
        weight = base.weight
        if kind == "column":
            out_local, in_full = weight.shape
            a_shape, b_shape, m_shape = (dim, in_full), (out_local, dim), (out_local,)
        else:
            out_full, in_local = weight.shape
            a_shape, b_shape, m_shape = (dim, in_local), (out_full, dim), (out_full,)
        factory = {"device": weight.device, "dtype": weight.dtype}
        self.lora_A = torch.nn.Parameter(torch.zeros(a_shape, **factory))
        self.lora_B = torch.nn.Parameter(torch.zeros(b_shape, **factory))
        self.lora_magnitude = torch.nn.Parameter(torch.ones(m_shape, **factory)) if dora else None
        self._set_parallel_attributes()

    # ------------------------------------------------------------------ parameters
    def _set_parallel_attributes(self) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        allreduce = getattr(self.base_layer.weight, "allreduce", True)
        split = {"column": ("lora_B", "lora_magnitude"), "row": ("lora_A",)}[self.kind]
        axis = {"lora_A": 1, "lora_B": 0, "lora_magnitude": 0}
        # Under sequence parallelism these see only this rank's sequence chunk: sum over TP.
        partial = {"column": ("lora_A",), "row": ("lora_B", "lora_magnitude")}[self.kind]
        for name in ADAPTER_PARAMS:
            param = getattr(self, name)
            if param is None:
                continue
            is_split = name in split and self.tp_size > 1
            set_tensor_model_parallel_attributes(param, is_split, axis[name] if is_split else 0, 1)
            param.allreduce = allreduce
            param.sequence_parallel = self.sequence_parallel and name in partial

    def adapter_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, getattr(self, n)) for n in ADAPTER_PARAMS if getattr(self, n) is not None]

    @torch.no_grad()
    def init_adapter(self, a_method: str, b_method: str, generator: torch.Generator) -> None:
        """Initialize A and B from full-size tensors drawn from `generator`, then keep this
        rank's part: with a generator seeded per module, every parallel layout starts from the
        same adapters."""
        rank = self.base_layer.tp_group.rank()
        a_full = (self.dim, self.lora_A.shape[1] * (self.tp_size if self.kind == "row" else 1))
        b_full = (self.lora_B.shape[0] * (self.tp_size if self.kind == "column" else 1), self.dim)
        a = _initialized(a_full, a_method, generator)
        b = _initialized(b_full, b_method, generator)
        if self.kind == "row":
            a = a.chunk(self.tp_size, dim=1)[rank]
        else:
            b = _column_shard(b, rank, self.tp_size, self.glu_fc1)
        self.lora_A.copy_(a)
        self.lora_B.copy_(b)
        if self.dora:
            self.reset_magnitude()

    @torch.no_grad()
    def reset_magnitude(self) -> None:
        """DoRA: set the magnitude to the row norms of the current (base + update) weight, so the
        adapted layer computes what the base layer computes."""
        self.lora_magnitude.copy_(self.weight_norm())

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A, in the shape of this rank's base weight."""
        return (self.lora_B @ self.lora_A) * self.scale

    def weight_norm(self) -> torch.Tensor:
        """Row norms of W + scale * B @ A over the whole input (summed over TP for row-parallel)."""
        w = self.base_layer.weight.detach().float() + self.delta_weight().detach().float()
        squares = (w * w).sum(dim=1)
        if self.kind == "row" and self.tp_size > 1:
            torch.distributed.all_reduce(squares, group=self.base_layer.tp_group)
        return squares.sqrt().to(self.base_layer.weight.dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        out, bias = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return out, bias
        inner_bias = (
            self.base_layer.bias if (self.base_layer.bias is not None and not self.base_layer.skip_bias_add) else None
        )
        delta = self._lora(x)
        if not self.dora:
            return out + delta, bias
        ratio = (self.lora_magnitude / self.weight_norm()).to(out.dtype)
        plain = out - inner_bias if inner_bias is not None else out
        result = ratio * (plain + delta)
        return (result + inner_bias if inner_bias is not None else result), bias

    def _lora(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpar

        group = self.base_layer.tp_group
        if self.dropout_position == "pre":
            x = self._dropout(x, split=self.kind == "row" or self.sequence_parallel)
        h = F.linear(x, self.lora_A)
        if self.kind == "column":
            if self.sequence_parallel:
                h = tpar.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=group)
            elif self.tp_size > 1 and not self.explicit_comm:
                h = tpar.copy_to_tensor_model_parallel_region(h, group=group)
        elif not self.explicit_comm:
            if self.sequence_parallel:
                h = tpar.reduce_scatter_to_sequence_parallel_region(h, group=group)
            elif self.tp_size > 1:
                h = tpar.reduce_from_tensor_model_parallel_region(h, group=group)
        out = F.linear(h, self.lora_B) * self.scale
        if self.dropout_position == "post":
            out = self._dropout(out, split=self.kind == "column" or self.sequence_parallel)
        return out

    def _dropout(self, x: torch.Tensor, split: bool) -> torch.Tensor:
        """Dropout on a tensor that differs over TP ranks (`split`: per-rank streams, as
        megatron-core does for split activations) or is the same on all of them (one stream)."""
        if not self.training or self.dropout_p == 0.0:
            return x
        if split and self.tp_size > 1:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return F.dropout(x, self.dropout_p, True)
        return F.dropout(x, self.dropout_p, True)

    # ------------------------------------------------------------------ merging
    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapter into the base weight (the layer then computes the same function
        without the adapter path)."""
        if self.merged:
            return
        self.base_layer.weight.copy_(self.merged_weight())
        self.merged = True

    @torch.no_grad()
    def merged_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """This rank's part of the folded weight, W + scale * B @ A (DoRA: each row rescaled to
        its magnitude), computed in fp32 and returned in `dtype` (default: W's); the layer is
        unchanged."""
        weight = self.base_layer.weight
        if self.merged:
            return weight.detach().to(dtype or weight.dtype)
        merged = weight.float() + self.delta_weight().float()
        if self.dora:
            merged = merged * (self.lora_magnitude.float() / self.weight_norm().float()).unsqueeze(1)
        return merged.to(dtype or weight.dtype)

    # ------------------------------------------------------------------ checkpoints
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The base layer's entries under their usual keys, and the adapter's, sharded like the
        base weight (gated first projections stored as all gates then all ups)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = self.base_layer.sharded_state_dict(prefix, sharded_offsets, metadata)
        tensors = {name: param for name, param in self.adapter_parameters()}
        axis = {"column": {"lora_B": 0, "lora_magnitude": 0}, "row": {"lora_A": 1}}[self.kind]
        adapter = make_sharded_tensors_for_checkpoint(
            tensors, prefix, axis, sharded_offsets, tp_group=self.base_layer.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )  # fmt: skip
        if self.glu_fc1:
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            singleton = (metadata or {}).get("singleton_local_shards", False)
            for name in ("lora_B", "lora_magnitude"):
                key = f"{prefix}{name}"
                if key in adapter:
                    adapter[key] = apply_swiglu_sharded_factory(adapter[key], sharded_offsets, singleton)
        sd.update(adapter)
        return sd

    def get_extra_state(self) -> Any:
        return self.base_layer.get_extra_state()

    def set_extra_state(self, state: Any) -> None:
        self.base_layer.set_extra_state(state)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.setdefault(f"{prefix}_extra_state")  # as the base layer's own load hook does
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def backward_dw(self) -> None:
        self.base_layer.backward_dw()

    def train(self, mode: bool = True) -> "AdaptedLinear":
        super().train(mode)
        self.base_layer.train(mode)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__.get("base_layer")
            if base is None:
                raise
            return getattr(base, name)  # config, tp_group, input_size, ... of the base layer

    def extra_repr(self) -> str:
        method = "DoRA" if self.dora else "LoRA"
        return f"{method}(dim={self.dim}, scale={self.scale:g}, {self.kind}-parallel, TP={self.tp_size})"


def _initialized(shape: tuple[int, int], method: str, generator: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32)
    if method == "zero":
        return t.zero_()
    if method == "xavier":
        return torch.nn.init.xavier_uniform_(t, generator=generator)
    if method == "kaiming":
        return torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator)
    if method == "normal":
        return torch.nn.init.normal_(t, std=0.02, generator=generator)
    raise ValueError(f"unknown init method {method!r}")


def _column_shard(full: torch.Tensor, rank: int, tp: int, glu: bool) -> torch.Tensor:
    """This rank's rows of a column-parallel tensor (a gated projection holds its slice of the
    gate rows and its slice of the up rows)."""
    if not glu:
        return full.chunk(tp, dim=0)[rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
