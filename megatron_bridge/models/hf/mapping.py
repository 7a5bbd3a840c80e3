"""Which Hugging Face tensors make each megatron-core parameter, and how.

A megatron-core parameter is named globally (layer and expert numbers of the whole model, not of
this pipeline stage or expert-parallel rank) and mapped to a `Rule`:

* `Copy`: one Hugging Face tensor, split over tensor-parallel ranks along the parameter's
  partition dimension (or replicated);
* `Vocab`: embedding / output rows, split over tensor-parallel ranks with the vocabulary padded
  to a multiple (padding rows are zero on load and dropped on export);
* `QKV`: megatron-core's fused query/key/value projection, laid out per query group: the group's
  query heads, then its key head, then its value head; tensor-parallel ranks hold whole groups;
* `Gated`: the gated MLP input projection, [gate; up] on every tensor-parallel rank;
* `FusedQKV`, `FusedGated`: the same from one Hugging Face tensor (`qkv_proj`, `gate_up_proj`).

Which parameters a model has and their rules come from its family (`HFFamily`, one module per
Hugging Face architecture, see `megatron_bridge.models`), which names them as megatron-core's
local layers (`input_layernorm`, `pre_mlp_layernorm`) and sequential experts
(`experts.local_experts.E.linear_fc1.weight`) do; TransformerEngine's fused names
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) and grouped experts
(`experts.linear_fc1.weightE`) are translated to those here, for every family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional
from megatron_bridge.models.hf.registry import family_for_config

if TYPE_CHECKING:
    import torch

    from megatron_bridge.models.hf.reader import SafetensorsReader


@dataclass(frozen=True)
class Partition:
    """How a parameter is split: along `dim` (None: replicated) into `size` parts, this rank
    holding part `rank`."""

    dim: Optional[int] = None
    rank: int = 0
    size: int = 1


class Rule:
    """How one megatron-core parameter is made of Hugging Face tensors."""

    hf: tuple[str, ...] = ()

    reorders_rows: bool = False
    """Its Hugging Face tensor holds the parameter's rows in another order (`to_hf` reorders
    them); LoRA adapters' B rows are exported in that order too."""

    export_dtype: Optional[str] = None
    """The dtype its Hugging Face tensors are written in whatever the export's ('float32'), or
    None (the export's)."""

    def load(self, reader: "SafetensorsReader", dest: "torch.Tensor", part: Partition) -> None:
        """Fill `dest` (this rank's part of the parameter) from the Hugging Face tensors."""
        raise NotImplementedError

    def to_hf(self, parts: list["torch.Tensor"], part: Partition) -> dict[str, "torch.Tensor"]:
        """The Hugging Face tensors, from the parameter's parts on every tensor-parallel rank."""
        raise NotImplementedError

    def hf_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Shapes of the Hugging Face tensors made from a parameter of (whole) `shape`."""
        raise NotImplementedError

    def mapped(self, reader: "SafetensorsReader", dest: "torch.Tensor", part: Partition) -> Optional["torch.Tensor"]:
        """A view of the mapped file that `load` would copy into `dest`, if it is one whole-row
        slice of one tensor in `dest`'s dtype; else None."""
        return None


def partition(name: str, local: tuple[int, ...], full: tuple[int, ...], rank: int, size: int, padded: bool = False) -> Partition:
    """How this rank's `local` part relates to the `full` parameter: replicated, or split along
    the one dimension where they differ. `padded`: that dimension may be padded (vocabulary)."""
    local, full = tuple(local), tuple(full)
    if local == full and not (padded and size > 1):
        return Partition()
    diffs = [d for d, (a, b) in enumerate(zip(local, full)) if a != b] if len(local) == len(full) else None
    if not diffs and padded:
        diffs = [0]
    if not diffs or len(diffs) != 1:
        raise ValueError(f"{name}: this rank holds shape {list(local)}, which is no split of {list(full)}")
    d = diffs[0]
    fits = local[d] * size >= full[d] if padded else local[d] * size == full[d]
    if not fits:
        raise ValueError(f"{name}: this rank holds shape {list(local)}, which is no {size}-way split of {list(full)}")
    return Partition(d, rank, size)


@dataclass
class Copy(Rule):
    name: str

    @property
    def hf(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.name,)

    def load(self, reader, dest, part):
        if part.dim is None:
            reader.read_into(dest, self.name)
            return
        n = dest.shape[part.dim]
        reader.read_into(dest, self.name, part.dim, part.rank * n, (part.rank + 1) * n)

    def mapped(self, reader, dest, part):
        if part.dim is None:
            return reader.mapped(self.name, dest)
        n = dest.shape[part.dim]
        return reader.mapped(self.name, dest, part.dim, part.rank * n, (part.rank + 1) * n) if part.dim == 0 else None

    def to_hf(self, parts, part):
        import torch

        whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=part.dim)
        return {self.name: whole}

    def hf_shapes(self, shape):
        return {self.name: tuple(shape)}


@dataclass
class Vocab(Rule):
    """Embedding or output-layer rows; `vocab` real rows, the rest padding."""

    name: str
    vocab: int
    export: bool = True
    """False for a tied output layer: the embedding carries the weights."""

    @property
    def hf(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.name,)

    def load(self, reader, dest, part):
        n = dest.shape[0]
        start, stop = part.rank * n, min((part.rank + 1) * n, self.vocab)
        if stop > start:
            reader.read_into(dest[: stop - start], self.name, 0, start, stop)
        dest[max(stop - start, 0) :].zero_()  # padding rows

    def mapped(self, reader, dest, part):
        n = dest.shape[0]
        start = part.rank * n
        return reader.mapped(self.name, dest, 0, start, start + n) if start + n <= self.vocab else None

    def to_hf(self, parts, part):
        import torch

        if not self.export:
            return {}
        whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return {self.name: whole[: self.vocab]}

    def hf_shapes(self, shape):
        return {self.name: (self.vocab, *shape[1:])} if self.export else {}


@dataclass
class QKV(Rule):
    q: str
    k: str
    v: str
    heads: int
    groups: int
    head_dim: int

    @property
    def hf(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.q, self.k, self.v)

    def offsets(self) -> tuple[int, int, int]:
        """First row of the query, key and value heads in their tensors."""
        return (0, 0, 0)

    def load(self, reader, dest, part):
        local = self.groups // part.size
        g0, hpg, hd = part.rank * local, self.heads // self.groups, self.head_dim
        if dest.shape[0] != local * (hpg + 2) * hd:
            raise ValueError(f"{self.q}: the fused projection of {local} query groups has {local * (hpg + 2) * hd} rows, the model expects {dest.shape[0]}")
        q0, k0, v0 = self.offsets()
        for j in range(local):  # each group: its query heads, its key head, its value head
            g, base = g0 + j, j * (hpg + 2) * hd
            q, k, v = base, base + hpg * hd, base + (hpg + 1) * hd
            reader.read_into(dest[q:k], self.q, 0, q0 + g * hpg * hd, q0 + (g + 1) * hpg * hd)
            reader.read_into(dest[k:v], self.k, 0, k0 + g * hd, k0 + (g + 1) * hd)
            reader.read_into(dest[v : v + hd], self.v, 0, v0 + g * hd, v0 + (g + 1) * hd)

    def split(self, parts: list["torch.Tensor"]) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
        """(all query heads, all key heads, all value heads) of the parameter's parts."""
        import torch

        whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        hpg, hd = self.heads // self.groups, self.head_dim
        rest = tuple(whole.shape[1:])
        grouped = whole.reshape(self.groups, (hpg + 2) * hd, *rest)
        q, k, v = torch.split(grouped, [hpg * hd, hd, hd], dim=1)
        return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)

    def to_hf(self, parts, part):
        q, k, v = self.split(parts)
        return {self.q: q, self.k: k, self.v: v}

    def hf_shapes(self, shape):
        rest = tuple(shape[1:])
        kv = self.groups * self.head_dim
        return {self.q: (self.heads * self.head_dim, *rest), self.k: (kv, *rest), self.v: (kv, *rest)}


class FusedQKV(QKV):
    """`QKV` from one Hugging Face tensor holding all query heads, then all key heads, then all
    value heads (a fused `qkv_proj`)."""

    def __init__(self, name: str, heads: int, groups: int, head_dim: int):
        super().__init__(name, name, name, heads, groups, head_dim)

    @property
    def hf(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.q,)

    def offsets(self):
        return (0, self.heads * self.head_dim, (self.heads + self.groups) * self.head_dim)

    def to_hf(self, parts, part):
        import torch

        return {self.q: torch.cat(self.split(parts))}

    def hf_shapes(self, shape):
        return {self.q: tuple(shape)}


@dataclass
class Gated(Rule):
    gate: str
    up: str

    @property
    def hf(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.gate, self.up)

    def load(self, reader, dest, part):
        n = dest.shape[0] // 2
        start, stop = part.rank * n, (part.rank + 1) * n
        reader.read_into(dest[:n], self.gate, 0, start, stop)
        reader.read_into(dest[n:], self.up, 0, start, stop)

    def to_hf(self, parts, part):
        import torch

        halves = [p.chunk(2, dim=0) for p in parts]
        if len(halves) == 1:  # row halves of one tensor: contiguous already, no copy
            return {self.gate: halves[0][0], self.up: halves[0][1]}
        return {self.gate: torch.cat([h[0] for h in halves]), self.up: torch.cat([h[1] for h in halves])}

    def hf_shapes(self, shape):
        half = (shape[0] // 2, *shape[1:])
        return {self.gate: half, self.up: half}


@dataclass
class FusedGated(Rule):
    """The gated MLP input projection from one Hugging Face tensor, [all gate rows; all up rows]
    (a fused `gate_up_proj`); [gate; up] on every tensor-parallel rank."""

    name: str

    @property
    def hf(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.name,)

    def load(self, reader, dest, part):
        n = dest.shape[0] // 2
        whole = reader.info(self.name).shape[0] // 2
        start, stop = part.rank * n, (part.rank + 1) * n
        reader.read_into(dest[:n], self.name, 0, start, stop)
        reader.read_into(dest[n:], self.name, 0, whole + start, whole + stop)

    def mapped(self, reader, dest, part):
        return reader.mapped(self.name, dest) if part.size == 1 else None

    def to_hf(self, parts, part):
        import torch

        if len(parts) == 1:  # already [gate; up]
            return {self.name: parts[0]}
        halves = [p.chunk(2, dim=0) for p in parts]
        return {self.name: torch.cat([h[0] for h in halves] + [h[1] for h in halves])}

    def hf_shapes(self, shape):
        return {self.name: tuple(shape)}


# ---------------------------------------------------------------------- names
@dataclass(frozen=True)
class Mapped:
    """A megatron-core parameter: its whole shape (vocabulary unpadded) and the rule that makes it
    of Hugging Face tensors."""

    shape: tuple[int, ...]
    rule: Rule


@dataclass(frozen=True)
class Architecture:
    """What the mapping needs to know about a model, from its config.json. `family` (an
    `HFFamily`) lays out the tensors; `hf` is the whole config.json, for what only the family
    reads."""

    family: Any
    num_layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    tied: bool
    ffn: int = 0
    num_experts: int = 0
    moe_ffn: int = 0
    hf: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def model_type(self) -> str:
        return self.family.model_type


def architecture(hf: dict) -> Architecture:
    """The `Architecture` of a parsed (and accepted) config.json."""
    return family_for_config(hf).architecture_of(hf)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")
FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}
"""TransformerEngine's norms fused into the next linear layer -> the local layers' names."""


def entry_for(arch: Architecture, name: str) -> Optional[Mapped]:
    """The `Mapped` of the megatron-core parameter `name` (global layer and expert numbers;
    local or TransformerEngine layers, sequential or grouped experts), or None if no Hugging
    Face tensor maps to it. Families name parameters as megatron-core's local layers and
    sequential experts do."""
    family = arch.family
    if not name.startswith("decoder.layers."):
        return family.global_tensors(arch).get(name)
    match = _LAYER.match(name)
    if not match:
        return None
    layer, rest = int(match.group(1)), match.group(2)
    rest = FUSED_NORMS.get(rest, rest)
    grouped = _GROUPED_EXPERT.match(rest)
    if grouped:
        rest = f"mlp.experts.local_experts.{grouped.group(2)}.{grouped.group(1)}.weight"
    expert = _SEQUENTIAL_EXPERT.match(rest)
    if expert:
        if not arch.num_experts:
            return None
        return family.expert_tensors(arch, layer, int(expert.group(1))).get(expert.group(2))
    return family.layer_tensors(arch, layer).get(rest)


def rule_for(arch: Architecture, name: str) -> Optional[Rule]:
    """The rule of the megatron-core parameter `name` (see `entry_for`), or None."""
    entry = entry_for(arch, name)
    return None if entry is None else entry.rule


def all_entries(arch: Architecture) -> dict[str, Mapped]:
    """Every megatron-core parameter of the whole model (global names, local-layer naming)."""
    family = arch.family
    out = dict(family.global_tensors(arch))
    for L in range(arch.num_layers):
        out.update({f"decoder.layers.{L}.{k}": v for k, v in family.layer_tensors(arch, L).items()})
        for e in range(arch.num_experts):
            experts = family.expert_tensors(arch, L, e)
            out.update({f"decoder.layers.{L}.mlp.experts.local_experts.{e}.{k}": v for k, v in experts.items()})
    return out


def expected_tensors(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `arch` holds, with its shape (the lm_head of a
    tied model is optional and not listed)."""
    out: dict[str, tuple[int, ...]] = {}
    for entry in all_entries(arch).values():
        out.update(entry.rule.hf_shapes(entry.shape))
    return out


IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
"""Tensors some checkpoints carry that are recomputed, not loaded."""


def global_names(model: Any, num_experts: int, expert_rank: int) -> Callable[[str], str]:
    """A function turning the parameter names of `model` (one pipeline stage of a GPTModel, on
    one expert-parallel rank) into global names: the model's layer numbers and expert numbers."""
    offsets = {}
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        for i, layer in enumerate(decoder.layers):
            offsets[i] = layer.layer_number - 1
    local_experts = 0
    if num_experts:
        from megatron.core import parallel_state

        local_experts = num_experts // parallel_state.get_expert_model_parallel_world_size()

    def rename(local: str) -> str:
        match = _LAYER.match(local)
        if not match:
            return local
        layer, rest = offsets[int(match.group(1))], match.group(2)
        expert = _SEQUENTIAL_EXPERT.match(rest)
        if expert:
            number = expert_rank * local_experts + int(expert.group(1))
            rest = f"mlp.experts.local_experts.{number}.{expert.group(2)}"
        else:
            expert = _GROUPED_EXPERT.match(rest)
            if expert:
                rest = f"mlp.experts.{expert.group(1)}.weight{expert_rank * local_experts + int(expert.group(2))}"
        return f"decoder.layers.{layer}.{rest}"

    return rename


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name
