"""LoRA and DoRA adapters in the plan: their parameters and what they keep for backward.

`megatron_bridge.peft.apply` freezes every parameter of the model and wraps each targeted linear
layer in an `AdaptedLinear` (see `megatron_bridge.peft.modules`), whose parameters are
registered after the base layer's:

    column-parallel (linear_qkv, linear_fc1):  lora_A [r, in]     lora_B [out/TP, r]   magnitude [out/TP]
    row-parallel (linear_proj, linear_fc2):    lora_A [r, in/TP]  lora_B [out, r]      magnitude [out]

(magnitude: DoRA only; experts split by ETP, which must be 1). Only these are trainable, so
megatron-core's DDP puts only them into gradient buffers (and, with the distributed optimizer,
parameter buffers) and the optimizer holds state for them alone; the frozen base stays in its
16-bit parameters.

Multi-latent attention on local layers builds every projection but the output one as a
column-parallel layer that does not gather its output, the down projections included (their
outputs are gathered after them), so these are adapted like linear_qkv (in -> out features):

    linear_q_proj        hidden -> heads x (qk_head_dim + qk_rope_dim)     (q_lora_rank unset)
    linear_q_down_proj   hidden -> q_lora_rank
    linear_q_up_proj     q_lora_rank -> heads x (qk_head_dim + qk_rope_dim)
    linear_kv_down_proj  hidden -> kv_lora_rank + qk_rope_dim
    linear_kv_up_proj    kv_lora_rank -> heads x (qk_head_dim + v_head_dim)
    linear_proj          heads x v_head_dim -> hidden                      (row-parallel)

TransformerEngine layers keep the down projections whole on every rank, and they are planned so;
adapters do not wrap TransformerEngine's layers, so such a plan is of a run that refuses to start.

In the forward pass an adapter keeps, besides the input its base layer keeps anyway: the rank-r
intermediate A x (the input of B), with dropout its mask and dropped input ('pre') or output
mask ('post'), and with DoRA the update before the per-row magnitude scaling (one value per
output feature and token) and, per output feature, the weight norm and the magnitude's ratio to it.
"""

from __future__ import annotations

from typing import NamedTuple

from megatron_bridge.planning.inputs import PlanInputs

ADAPTER_PARAMS = ("lora_A", "lora_B", "lora_magnitude")


class Adapted(NamedTuple):
    """The shape of one adapted linear layer on one rank."""

    column: bool
    """Column-parallel (output split) rather than row-parallel (input split)."""
    in_features: int
    """Full input width (before any split)."""
    out_features: int
    """Full output width."""
    split: int
    """Tensor-parallel size it is split over (ETP for experts)."""
    expert: bool
    tokens_fraction: float
    """Share of the rank's tokens × top-k it processes (1 for dense layers)."""


def module_shape(inp: PlanInputs, rel: str) -> Adapted:
    """The shape of the linear layer `rel` (named relative to its layer)."""
    gated = 2 if inp.gated else 1
    h, q = inp.hidden, inp.heads * inp.kv_channels
    leaf = rel.rsplit(".", 1)[-1]
    if ".experts." in rel:
        ffn, split = inp.moe_ffn, inp.etp
        local = max(1, inp.num_experts // inp.ep)
        fraction = inp.topk / local  # tokens spread evenly over the rank's experts
        expert = True
    elif ".shared_experts." in rel:
        ffn, split, fraction, expert = inp.shared_expert_ffn, inp.tp, 1.0, False
    else:
        ffn, split, fraction, expert = inp.ffn, inp.tp, 1.0, False
    if inp.mla and leaf in _MLA_LEAVES:
        return _mla_shape(inp, leaf)
    if leaf == "linear_qkv":
        return Adapted(True, h, q + 2 * inp.query_groups * inp.kv_channels, inp.tp, False, 1.0)
    if leaf == "linear_proj":
        return Adapted(False, q, h, inp.tp, False, 1.0)
    if leaf == "linear_fc1":
        return Adapted(True, h, ffn * gated, split, expert, fraction)
    return Adapted(False, ffn, h, split, expert, fraction)


_MLA_LEAVES = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
               "linear_kv_up_proj", "linear_proj")  # fmt: skip


def _mla_shape(inp: PlanInputs, leaf: str) -> Adapted:
    """The shape of a projection of multi-latent attention (see the module docstring)."""
    h, heads, tp = inp.hidden, inp.heads, inp.tp
    query = heads * (inp.qk_head_dim + inp.qk_rope_dim)
    down_split = 1 if inp.transformer_engine else tp
    shapes = {  # in features, out features, split
        "linear_q_proj": (h, query, tp),
        "linear_q_down_proj": (h, inp.q_lora_rank, down_split),
        "linear_q_up_proj": (inp.q_lora_rank, query, tp),
        "linear_kv_down_proj": (h, inp.kv_lora_rank + inp.qk_rope_dim, down_split),
        "linear_kv_up_proj": (inp.kv_lora_rank, heads * (inp.qk_head_dim + inp.v_head_dim), tp),
    }
    if leaf == "linear_proj":
        return Adapted(False, heads * inp.v_head_dim, h, tp, False, 1.0)
    in_features, out_features, split = shapes[leaf]
    return Adapted(True, in_features, out_features, split, False, 1.0)


def adapter_params(inp: PlanInputs, rel: str) -> list[tuple[str, int]]:
    """(name, elements) of the adapter parameters of `rel` on one rank, in registration order."""
    a = module_shape(inp, rel)
    r = inp.peft_dim
    if a.column:
        out = [(f"{rel}.lora_A", r * a.in_features), (f"{rel}.lora_B", a.out_features // a.split * r)]
        magnitude = a.out_features // a.split
    else:
        out = [(f"{rel}.lora_A", r * (a.in_features // a.split)), (f"{rel}.lora_B", a.out_features * r)]
        magnitude = a.out_features
    if inp.peft == "dora":
        out.append((f"{rel}.lora_magnitude", magnitude))
    return out


def local_adapted(inp: PlanInputs, layer: int) -> tuple[str, ...]:
    """The adapted modules of global layer `layer` on the first expert-parallel rank (expert
    numbers made local)."""
    if not inp.peft_modules:
        return ()
    local = max(1, inp.num_experts // inp.ep) if inp.num_experts else 0
    out = []
    for rel in inp.peft_modules[layer]:
        if ".experts.local_experts." in rel:
            head, rest = rel.split(".experts.local_experts.", 1)
            number, tail = rest.split(".", 1)
            if int(number) >= local:
                continue  # held by another expert-parallel rank
        out.append(rel)
    return tuple(out)


def activation_terms(inp: PlanInputs, adapted: tuple[str, ...], s: float, b: int) -> dict[str, float]:
    """Bytes the adapters of one layer keep for backward, per micro batch (s: this rank's
    sequence length before any sequence-parallel split)."""
    e, r = inp.activation_bytes, inp.peft_dim
    sp = inp.tp if inp.sequence_parallel else 1
    terms: dict[str, float] = {}

    def add(name: str, value: float) -> None:
        if value:
            terms[name] = terms.get(name, 0.0) + value

    for rel in adapted:
        a = module_shape(inp, rel)
        tokens = s * b * a.tokens_fraction
        if a.column:  # input: the rank's sequence chunk, full width; output: full sequence, out/TP
            in_tokens, in_width = tokens / (1 if a.expert else sp), a.in_features
            out_tokens, out_width = tokens, a.out_features / a.split
            rank_tokens = tokens  # A x is gathered over the sequence before B
        else:  # input: full sequence, in/TP; output: reduce-scattered over the sequence
            in_tokens, in_width = tokens, a.in_features / a.split
            out_tokens, out_width = tokens / (1 if a.expert else sp), a.out_features
            rank_tokens = out_tokens
        add("adapter rank-r intermediates (A x)", e * r * rank_tokens)
        if inp.peft_dropout > 0 and inp.peft_dropout_position == "pre":
            add("adapter dropout masks and dropped inputs", (1 + e) * in_tokens * in_width)
        elif inp.peft_dropout > 0:
            add("adapter dropout masks", out_tokens * out_width)
        if inp.peft == "dora":
            add("DoRA updates before the magnitude scaling", e * out_tokens * out_width)
            # the magnitude over the weight norm, and that norm (the divisor), per output feature
            add("DoRA magnitude ratios and weight norms", 2 * e * a.out_features / (a.split if a.column else 1))
    return terms
