"""Rules for Hugging Face tensors that hold every expert of a layer, stacked along their first
dimension (`mlp.experts.gate_up_proj` [experts, hidden, 2 x ffn], as GPT-OSS stores them).

megatron-core keeps one parameter per expert, so each expert's parameter maps to one slice
`[expert]` of the stacked tensor, in a layout of its own:

* `transposed`: the slice is the parameter transposed (Hugging Face keeps experts as
  [in, out] matrices, megatron-core's linear layers as [out, in]);
* `interleaved`: the slice's last dimension alternates gate and up (gate at even positions, up at
  odd ones), where megatron-core's gated `linear_fc1` holds all gate rows, then all up rows.

A rank reads its experts' slices only. On export each expert parameter gives its slice (`to_hf`
returns it under the stacked tensor's name), and the writer assembles the tensor from the slices
of every expert, gathered over expert-parallel ranks (`stack_index`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_bridge.models.hf.mapping import Partition, Rule

if TYPE_CHECKING:
    import torch


@dataclass
class ExpertSlice(Rule):
    """Expert `expert` of the stacked tensor `name` ([experts, ...]) as one megatron-core
    parameter. `gated`: the parameter is [gate rows; up rows] and each tensor-parallel rank holds
    [its gate rows; its up rows], as megatron-core splits a gated `linear_fc1`."""

    name: str
    expert: int
    experts: int
    transposed: bool = False
    interleaved: bool = False
    gated: bool = False

    @property
    def hf(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.name,)

    @property
    def stack_index(self) -> tuple[int, int]:
        """(slice, slices) of the stacked tensor this parameter gives."""
        return self.expert, self.experts

    # ------------------------------------------------------------------ layouts
    def to_megatron(self, piece: "torch.Tensor") -> "torch.Tensor":
        """The whole parameter from its slice of the stacked tensor."""
        import torch

        if self.interleaved:
            piece = torch.cat([piece[..., 0::2], piece[..., 1::2]], dim=-1)
        return piece.t() if self.transposed else piece

    def from_megatron(self, whole: "torch.Tensor") -> "torch.Tensor":
        """The slice of the stacked tensor from the whole parameter."""
        import torch

        piece = whole.t() if self.transposed else whole
        if self.interleaved:
            gate, up = piece.chunk(2, dim=-1)
            piece = torch.stack([gate, up], dim=-1).flatten(-2)
        return piece.contiguous()

    # ------------------------------------------------------------------ tensor-parallel parts
    def select(self, whole: "torch.Tensor", part: Partition) -> "torch.Tensor":
        """This rank's part of the whole parameter."""
        import torch

        if part.dim is None or part.size == 1:
            return whole
        if self.gated:
            gate, up = whole.chunk(2, dim=0)
            return torch.cat([gate.chunk(part.size, dim=0)[part.rank], up.chunk(part.size, dim=0)[part.rank]])
        return whole.chunk(part.size, dim=part.dim)[part.rank]

    def assemble(self, parts: list["torch.Tensor"], part: Partition) -> "torch.Tensor":
        """The whole parameter from every rank's part."""
        import torch

        if len(parts) == 1:
            return parts[0]
        if self.gated:
            halves = [p.chunk(2, dim=0) for p in parts]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        return torch.cat(parts, dim=part.dim)

    # ------------------------------------------------------------------ Rule
    def load(self, reader, dest, part):
        piece = reader.read(self.name, 0, self.expert, self.expert + 1)[0]
        dest.copy_(self.select(self.to_megatron(piece), part))

    def to_hf(self, parts, part):
        return {self.name: self.from_megatron(self.assemble(parts, part))}

    def hf_shapes(self, shape):
        slice_shape = tuple(reversed(shape)) if self.transposed else tuple(shape)
        return {self.name: (self.experts, *slice_shape)}
