"""Which Hugging Face tensors make each megatron-core parameter, and how.

A megatron-core parameter is named globally (layer and expert numbers of the whole model, not of
this pipeline stage or expert-parallel rank) and mapped to a `Rule`:

* `Copy`: one Hugging Face tensor, split over tensor-parallel ranks along the parameter's
  partition dimension (or replicated);
* `Vocab`: embedding / output rows, split over tensor-parallel ranks with the vocabulary padded
  to a multiple (padding rows are zero on load and dropped on export);
* `QKV`: megatron-core's fused query/key/value projection, laid out per query group: the group's
  query heads, then its key head, then its value head; tensor-parallel ranks hold whole groups;
* `Gated`: the gated MLP input projection, [gate; up] on every tensor-parallel rank.

Both layer specs are covered: megatron-core's local layers (`input_layernorm`,
`pre_mlp_layernorm`) and TransformerEngine's fused ones (`linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`), and mixture-of-experts layers with sequential experts
(`experts.local_experts.E.linear_fc1.weight`) or TransformerEngine grouped experts
(`experts.linear_fc1.weightE`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

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

    def full_shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The whole parameter's shape (vocabulary unpadded), from the Hugging Face shapes."""
        return tuple(shapes[self.hf[0]])


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

    def load(self, reader, dest, part):
        local = self.groups // part.size
        g0, hpg, hd = part.rank * local, self.heads // self.groups, self.head_dim
        if dest.shape[0] != local * (hpg + 2) * hd:
            raise ValueError(f"{self.q}: the fused projection of {local} query groups has {local * (hpg + 2) * hd} rows, the model expects {dest.shape[0]}")
        for j in range(local):  # each group: its query heads, its key head, its value head
            g, base = g0 + j, j * (hpg + 2) * hd
            reader.read_into(dest[base : base + hpg * hd], self.q, 0, g * hpg * hd, (g + 1) * hpg * hd)
            reader.read_into(dest[base + hpg * hd : base + (hpg + 1) * hd], self.k, 0, g * hd, (g + 1) * hd)
            reader.read_into(dest[base + (hpg + 1) * hd : base + (hpg + 2) * hd], self.v, 0, g * hd, (g + 1) * hd)

    def to_hf(self, parts, part):
        import torch

        whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        hpg, hd = self.heads // self.groups, self.head_dim
        rest = tuple(whole.shape[1:])
        grouped = whole.reshape(self.groups, (hpg + 2) * hd, *rest)
        q, k, v = torch.split(grouped, [hpg * hd, hd, hd], dim=1)
        return {self.q: q.reshape(-1, *rest), self.k: k.reshape(-1, *rest), self.v: v.reshape(-1, *rest)}

    def hf_shapes(self, shape):
        rest = tuple(shape[1:])
        kv = self.groups * self.head_dim
        return {self.q: (self.heads * self.head_dim, *rest), self.k: (kv, *rest), self.v: (kv, *rest)}

    def full_shape(self, shapes):
        q, k, v = shapes[self.q], shapes[self.k], shapes[self.v]
        return (q[0] + k[0] + v[0], *q[1:])


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

    def full_shape(self, shapes):
        gate = shapes[self.gate]
        return (2 * gate[0], *gate[1:])


# ---------------------------------------------------------------------- names
@dataclass(frozen=True)
class Architecture:
    """What the mapping needs to know about a model (from its config.json)."""

    model_type: str
    num_layers: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    tied: bool
    num_experts: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False


def architecture(hf: dict) -> Architecture:
    """The `Architecture` of a parsed (and accepted) config.json."""
    from megatron_bridge.models.hf.config import BY_ARCHITECTURE, BY_MODEL_TYPE

    names = hf.get("architectures") or []
    family = BY_ARCHITECTURE[names[0]] if names else BY_MODEL_TYPE[hf["model_type"]]
    heads = hf["num_attention_heads"]
    kind = family.model_type
    return Architecture(
        model_type=kind,
        num_layers=hf["num_hidden_layers"],
        heads=heads,
        groups=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab=hf["vocab_size"],
        tied=bool(hf.get("tie_word_embeddings", False)),
        num_experts=(hf.get("num_experts") or hf.get("num_local_experts") or 0) if family.moe else 0,
        qkv_bias=kind == "qwen2",
        qk_norm=kind in ("qwen3", "qwen3_moe"),
    )


def _expert_names(arch: Architecture, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) tensor names of one expert."""
    if arch.model_type == "mixtral":
        base = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
        return f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"
    base = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight"


def _router_name(arch: Architecture, layer: int) -> str:
    block = "block_sparse_moe" if arch.model_type == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")


def _layer_rules(arch: Architecture, L: int) -> dict[str, Callable[[], Rule]]:
    attn, p = f"model.layers.{L}.self_attn", f"model.layers.{L}"
    qkv = lambda kind: QKV(f"{attn}.q_proj.{kind}", f"{attn}.k_proj.{kind}", f"{attn}.v_proj.{kind}", arch.heads, arch.groups, arch.head_dim)  # noqa: E731
    rules: dict[str, Callable[[], Rule]] = {
        "input_layernorm.weight": lambda: Copy(f"{p}.input_layernorm.weight"),
        "self_attention.linear_qkv.layer_norm_weight": lambda: Copy(f"{p}.input_layernorm.weight"),
        "self_attention.linear_qkv.weight": lambda: qkv("weight"),
        "self_attention.linear_proj.weight": lambda: Copy(f"{attn}.o_proj.weight"),
        "pre_mlp_layernorm.weight": lambda: Copy(f"{p}.post_attention_layernorm.weight"),
        "mlp.linear_fc1.layer_norm_weight": lambda: Copy(f"{p}.post_attention_layernorm.weight"),
    }
    if arch.qkv_bias:
        rules["self_attention.linear_qkv.bias"] = lambda: qkv("bias")
    if arch.qk_norm:
        rules["self_attention.q_layernorm.weight"] = lambda: Copy(f"{attn}.q_norm.weight")
        rules["self_attention.k_layernorm.weight"] = lambda: Copy(f"{attn}.k_norm.weight")
    if arch.num_experts:
        rules["mlp.router.weight"] = lambda: Copy(_router_name(arch, L))
    else:
        rules["mlp.linear_fc1.weight"] = lambda: Gated(f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight")
        rules["mlp.linear_fc2.weight"] = lambda: Copy(f"{p}.mlp.down_proj.weight")
    return rules


def rule_for(arch: Architecture, name: str) -> Optional[Rule]:
    """The rule of the megatron-core parameter `name` (global layer and expert numbers), or None
    if no Hugging Face tensor maps to it."""
    if name == "embedding.word_embeddings.weight":
        return Vocab("model.embed_tokens.weight", arch.vocab)
    if name == "output_layer.weight":
        return Vocab("model.embed_tokens.weight", arch.vocab, export=False) if arch.tied else Vocab("lm_head.weight", arch.vocab)
    if name == "decoder.final_layernorm.weight":
        return Copy("model.norm.weight")
    match = _LAYER.match(name)
    if not match:
        return None
    layer, rest = int(match.group(1)), match.group(2)
    make = _layer_rules(arch, layer).get(rest)
    if make is not None:
        return make()
    if not arch.num_experts:
        return None
    expert = _SEQUENTIAL_EXPERT.match(rest)
    if expert:
        number, which = int(expert.group(1)), expert.group(2)
    else:
        expert = _GROUPED_EXPERT.match(rest)
        if not expert:
            return None
        number, which = int(expert.group(2)), expert.group(1)
    gate, up, down = _expert_names(arch, layer, number)
    return Gated(gate, up) if which == "linear_fc1" else Copy(down)


def expected_tensors(arch: Architecture, hidden: int, ffn: int, moe_ffn: int = 0) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `arch` holds, with its shape (the lm_head of a
    tied model is optional and not listed)."""
    hd, q, kv = arch.head_dim, arch.heads * arch.head_dim, arch.groups * arch.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab, hidden), "model.norm.weight": (hidden,)}
    if not arch.tied:
        out["lm_head.weight"] = (arch.vocab, hidden)
    for L in range(arch.num_layers):
        p, attn = f"model.layers.{L}", f"model.layers.{L}.self_attn"
        out.update({
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{attn}.q_proj.weight": (q, hidden),
            f"{attn}.k_proj.weight": (kv, hidden),
            f"{attn}.v_proj.weight": (kv, hidden),
            f"{attn}.o_proj.weight": (hidden, q),
        })  # fmt: skip
        if arch.qkv_bias:
            out.update({f"{attn}.q_proj.bias": (q,), f"{attn}.k_proj.bias": (kv,), f"{attn}.v_proj.bias": (kv,)})
        if arch.qk_norm:
            out.update({f"{attn}.q_norm.weight": (hd,), f"{attn}.k_norm.weight": (hd,)})
        if arch.num_experts:
            out[_router_name(arch, L)] = (arch.num_experts, hidden)
            for e in range(arch.num_experts):
                gate, up, down = _expert_names(arch, L, e)
                out.update({gate: (moe_ffn, hidden), up: (moe_ffn, hidden), down: (hidden, moe_ffn)})
        else:
            out.update({
                f"{p}.mlp.gate_proj.weight": (ffn, hidden),
                f"{p}.mlp.up_proj.weight": (ffn, hidden),
                f"{p}.mlp.down_proj.weight": (hidden, ffn),
            })  # fmt: skip
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
            rest = f"mlp.experts.local_experts.{number}.{expert.group(2)}.weight"
        else:
            expert = _GROUPED_EXPERT.match(rest)
            if expert:
                rest = f"mlp.experts.{expert.group(1)}.weight{expert_rank * local_experts + int(expert.group(2))}"
        return f"decoder.layers.{layer}.{rest}"

    return rename


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name
