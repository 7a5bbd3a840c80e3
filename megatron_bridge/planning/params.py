"""The parameters megatron-core's `GPTModel` allocates on one rank, in registration order.

Without building the model: per pipeline stage and virtual chunk, the layers it holds (as
megatron-core splits them), then each tensor with its local (TP/EP/ETP-split) size. The order is
the one `named_parameters()` yields for megatron-core's local layers (checked against a built
model in the tests); with TransformerEngine layers the norms are fused into the following linear
layer, which changes the order (and so the alignment padding of the distributed optimizer by a
few elements) but not the sizes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple, Optional

from megatron_bridge.planning.adapters import adapter_params, local_adapted
from megatron_bridge.planning.inputs import PlanInputs, PlanningError


class Param(NamedTuple):
    """One parameter tensor of a rank."""

    name: str
    numel: int
    expert: bool
    """In megatron-core's expert-parallel buffers (expert weights when EP > 1)."""
    shared_embedding: bool
    """The word embedding or its copy on the last stage (tied weights with PP > 1)."""
    fp8: bool = False
    """Stored as FP8 (TransformerEngine FP8 parameters)."""
    trainable: bool = True
    """False for the frozen base of a LoRA/DoRA run (not in DDP buffers, no optimizer state)."""


class Chunk(NamedTuple):
    """The model chunk of one (pipeline rank, virtual stage)."""

    pp_rank: int
    vp_stage: Optional[int]
    first_layer: int
    num_layers: int
    pre_process: bool
    post_process: bool


def _layers_to_build(inp: PlanInputs, pp_rank: int, vp_stage: Optional[int]) -> int:
    """megatron-core's `get_num_layers_to_build` (without a custom layout)."""
    pp, vp = inp.pp, inp.vp
    first, last = pp_rank == 0, pp_rank == pp - 1
    if inp.layers_first_stage is not None or inp.layers_last_stage is not None:
        left_layers, left_stages = inp.num_layers, pp
        for given in (inp.layers_first_stage, inp.layers_last_stage):
            if given is not None:
                left_layers -= given
                left_stages -= 1
        per_rank = left_layers // left_stages if left_stages > 0 else 0
        if first and inp.layers_first_stage is not None:
            per_rank = inp.layers_first_stage
        if last and inp.layers_last_stage is not None:
            per_rank = inp.layers_last_stage
    else:
        slots = inp.num_layers + int(inp.embedding_in_pipeline_split) + int(inp.loss_in_pipeline_split)
        if slots % pp:
            raise PlanningError(f"{slots} layer slots do not split over {pp} pipeline stages")
        per_rank = slots // pp
    count = per_rank // vp if vp else per_rank
    if inp.embedding_in_pipeline_split and first and (vp_stage in (None, 0)):
        count -= 1
    if inp.loss_in_pipeline_split and last and (vp_stage is None or vp_stage == vp - 1):
        count -= 1
    return count


def chunks(inp: PlanInputs) -> list[list[Chunk]]:
    """Per pipeline rank, its model chunks (one per virtual stage), with their layers. Layers are
    numbered in megatron-core's order: virtual stage major, then pipeline rank."""
    stages = [None] if not inp.vp else list(range(inp.vp))
    counts = {(v, r): _layers_to_build(inp, r, v) for v in stages for r in range(inp.pp)}
    if sum(counts.values()) != inp.num_layers:
        raise PlanningError(f"the pipeline split builds {sum(counts.values())} layers, not {inp.num_layers}")
    offsets, running = {}, 0
    for v in stages:
        for r in range(inp.pp):
            offsets[(v, r)] = running
            running += counts[(v, r)]
    last_v = stages[-1]
    return [
        [
            Chunk(
                pp_rank=r,
                vp_stage=v,
                first_layer=offsets[(v, r)],
                num_layers=counts[(v, r)],
                pre_process=r == 0 and v == stages[0],
                post_process=r == inp.pp - 1 and v == last_v,
            )
            for v in stages
        ]
        for r in range(inp.pp)
    ]


def _norm(prefix: str, width: int, has_bias: bool) -> list[tuple[str, int]]:
    out = [(f"{prefix}.weight", width)]
    if has_bias:
        out.append((f"{prefix}.bias", width))
    return out


def _linear(prefix: str, out_features: int, in_features: int, bias: Optional[int]) -> list[tuple[str, int]]:
    out = [(f"{prefix}.weight", out_features * in_features)]
    if bias is not None:
        out.append((f"{prefix}.bias", bias))
    return out


@lru_cache(maxsize=256)
def _layer_template(inp: PlanInputs, moe: bool, adapted: tuple[str, ...] = ()) -> tuple[Param, ...]:
    """The parameters of one transformer layer, named relative to the layer; with PEFT the base
    is frozen and each adapted linear layer is followed by its adapter's parameters."""
    params = _base_layer(inp, moe)
    if inp.peft is None:
        return params
    out: list[Param] = []
    pending = {f"{rel}.": rel for rel in adapted}
    for i, p in enumerate(params):
        out.append(p._replace(trainable=False))
        rel = next((r for prefix, r in pending.items() if p.name.startswith(prefix)), None)
        following = params[i + 1].name if i + 1 < len(params) else ""
        if rel is not None and not following.startswith(f"{rel}."):  # after the base layer's last parameter
            out += [Param(n, k, p.expert, False) for n, k in adapter_params(inp, rel)]
    return tuple(out)


def _base_layer(inp: PlanInputs, moe: bool) -> tuple[Param, ...]:
    """The parameters of one transformer layer as megatron-core builds it (no adapters)."""
    h, tp, d = inp.hidden, inp.tp, inp.kv_channels
    q_out, kv_out = inp.heads * d, 2 * inp.query_groups * d
    bias, te = inp.linear_bias, inp.transformer_engine
    nb = inp.norm_has_bias

    def col(prefix, out_full, in_full, with_bias, split=tp):
        return _linear(prefix, out_full // split, in_full, out_full // split if with_bias else None)

    def row(prefix, out_full, in_full, with_bias, split=tp):
        return _linear(prefix, out_full, in_full // split, out_full if with_bias else None)

    def fused_norm(linear: list[tuple[str, int]], module: str) -> list[tuple[str, int]]:
        # TE's LayerNorm+Linear registers the norm parameters before the weight.
        norm = [(f"{module}.layer_norm_weight", h)] + ([(f"{module}.layer_norm_bias", h)] if nb else [])
        return norm + linear

    def made(named: list[tuple[str, int]], expert: bool = False) -> list[Param]:
        return [Param(n, k, expert, False, inp.fp8_params and _is_linear_weight(n)) for n, k in named]

    # No input norms (input_norms False) is built on local layers only.
    input_norm = (lambda name: _norm(name, h, nb)) if inp.input_norms else (lambda name: [])  # noqa: E731
    attn: list[tuple[str, int]] = []
    if inp.mla:
        attn += input_norm("input_layernorm") + _mla_attention(inp, col, row)
    else:
        if not te:
            attn += input_norm("input_layernorm")
        if inp.attention_sinks:
            attn += [("self_attention.core_attention.softmax_offset", inp.heads // tp)]
        attn += row("self_attention.linear_proj", h, q_out, bias)
        qkv = col("self_attention.linear_qkv", q_out + kv_out, h, inp.qkv_bias)
        attn += fused_norm(qkv, "self_attention.linear_qkv") if te else qkv
        if inp.qk_layernorm and inp.qk_norm_per_head:
            attn += _norm("self_attention.q_layernorm", d, nb) + _norm("self_attention.k_layernorm", d, nb)
        elif inp.qk_layernorm:  # over the whole projection: this rank's heads
            attn += [("self_attention.q_layernorm.weight", q_out // tp)]
            attn += [("self_attention.k_layernorm.weight", kv_out // 2 // tp)]
    if inp.output_norms:
        attn += _norm("self_attn_bda.norm", h, nb)
    params = made(attn)
    output_norm = _norm("mlp_bda.norm", h, nb) if inp.output_norms else []

    gated = 2 if inp.gated else 1
    if not moe:
        fc1 = col("mlp.linear_fc1", inp.ffn * gated, h, bias)
        mlp = fused_norm(fc1, "mlp.linear_fc1") if te else input_norm("pre_mlp_layernorm") + fc1
        mlp += row("mlp.linear_fc2", h, inp.ffn, bias) + output_norm
        return tuple(params + made(mlp))

    # Mixture of experts: router, routed experts (local to this EP rank, split by ETP), shared experts.
    router = [("mlp.router.weight", inp.num_experts * h)] + ([("mlp.router.bias", inp.num_experts)] if bias else [])
    params += made(input_norm("pre_mlp_layernorm") + router)
    local = inp.num_experts // inp.ep
    expert_parallel = inp.ep > 1
    f, etp = inp.moe_ffn, inp.etp
    fc1_out, fc2_in = f * gated // etp, f // etp
    if inp.moe_grouped_gemm and not te:
        experts = [("mlp.experts.weight1", local * h * fc1_out), ("mlp.experts.weight2", local * fc2_in * h)]
    elif inp.moe_grouped_gemm:
        experts = [(f"mlp.experts.linear_fc1.weight{i}", fc1_out * h) for i in range(local)]
        experts += [(f"mlp.experts.linear_fc2.weight{i}", h * fc2_in) for i in range(local)]
    else:
        experts = []
        for i in range(local):
            experts += _linear(f"mlp.experts.local_experts.{i}.linear_fc1", fc1_out, h, fc1_out if bias else None)
            experts += _linear(f"mlp.experts.local_experts.{i}.linear_fc2", h, fc2_in, h if bias else None)
    params += made(experts, expert=expert_parallel)
    if inp.shared_expert_ffn:
        fs = inp.shared_expert_ffn
        shared = col("mlp.shared_experts.linear_fc1", fs * gated, h, bias) + row(
            "mlp.shared_experts.linear_fc2", h, fs, bias
        )
        if inp.shared_expert_gate:
            shared.append(("mlp.shared_experts.gate_weight", h))
        params += made(shared)
    return tuple(params + made(output_norm))


def _mla_attention(inp: PlanInputs, col: Any, row: Any) -> list[tuple[str, int]]:
    """Multi-latent attention's parameters after the input norm, in megatron-core's order: output
    projection, query projections, key/value projections, then the latent norms (fused into the
    up projections in TransformerEngine layers). Local layers split the down projections over
    TP (column-parallel, gathered); TransformerEngine's keep them whole on every rank."""
    h, heads, te = inp.hidden, inp.heads, inp.transformer_engine
    q_head = inp.qk_head_dim + inp.qk_rope_dim
    a = "self_attention"

    def down(name: str, width: int) -> list[tuple[str, int]]:
        return _linear(f"{a}.{name}", width, h, None) if te else col(f"{a}.{name}", width, h, False)

    def up(name: str, out_full: int, rank: int) -> list[tuple[str, int]]:
        weight = col(f"{a}.{name}", out_full, rank, False)
        return [(f"{a}.{name}.layer_norm_weight", rank)] + weight if inp.mla_fused_norms else weight

    params = row(f"{a}.linear_proj", h, heads * inp.v_head_dim, inp.linear_bias)
    if inp.q_lora_rank:
        params += down("linear_q_down_proj", inp.q_lora_rank) + up("linear_q_up_proj", heads * q_head, inp.q_lora_rank)
    else:
        params += col(f"{a}.linear_q_proj", heads * q_head, h, False)
    params += down("linear_kv_down_proj", inp.kv_lora_rank + inp.qk_rope_dim)
    params += up("linear_kv_up_proj", heads * (inp.qk_head_dim + inp.v_head_dim), inp.kv_lora_rank)
    if not inp.mla_fused_norms:
        if inp.q_lora_rank:
            params.append((f"{a}.q_layernorm.weight", inp.q_lora_rank))
        params.append((f"{a}.kv_layernorm.weight", inp.kv_lora_rank))
    return params


def _is_linear_weight(name: str) -> bool:
    """Weights that TransformerEngine keeps in FP8 with FP8 parameters (not norms, router, biases)."""
    return (".linear_" in name or ".experts." in name) and (name.endswith(".weight") or name[-1].isdigit())


def chunk_params(inp: PlanInputs, chunk: Chunk, names: bool = True) -> list[Param]:
    """The parameters of `chunk` on one rank, in `named_parameters()` order (`names=False`
    leaves layer parameters named relative to their layer, which is faster)."""
    h, tp = inp.hidden, inp.tp
    mtp = inp.mtp_depths if chunk.post_process else 0
    # A word embedding of the first stage is reduced with the last stage's copy: the tied output
    # layer's, or the embedding multi-token prediction looks the next tokens up in.
    shared = (inp.tied_embeddings or inp.mtp_depths > 0) and inp.pp > 1
    trains = inp.peft is None  # with PEFT only adapters train
    out: list[Param] = []
    if chunk.pre_process or mtp:
        out.append(
            Param(
                "embedding.word_embeddings.weight",
                inp.padded_vocab // tp * h,
                False,
                shared,
                trainable=trains,
            )
        )
        if inp.learned_positions:
            positions = inp.seq_length * h
            out.append(Param("embedding.position_embeddings.weight", positions, False, False, trainable=trains))
    for i in range(chunk.num_layers):
        layer = chunk.first_layer + i
        moe = inp.moe_layer_pattern[layer]
        template = _layer_template(inp, moe, local_adapted(inp, layer)) if inp.peft else _layer_template(inp, moe)
        if names:
            out += [p._replace(name=f"decoder.layers.{i}.{p.name}") for p in template]
        else:
            out += template
    if chunk.post_process:
        final_norm = _norm("decoder.final_layernorm", h, inp.norm_has_bias)
        out += [Param(n, k, False, False, trainable=trains) for n, k in final_norm]
        for depth in range(mtp):
            out += mtp_depth_params(inp, f"mtp.layers.{depth}." if names else "")
        if not (inp.tied_embeddings and chunk.pre_process):
            # with multi-token prediction the last stage's embedding is the tied copy; a tied
            # output layer there still allocates its own weight, which megatron-core does not use
            tied_copy = shared and inp.tied_embeddings and not mtp
            out.append(Param("output_layer.weight", inp.padded_vocab // tp * h, False, tied_copy, trainable=trains))
    return out


def mtp_depth_params(inp: PlanInputs, prefix: str = "") -> list[Param]:
    """One depth of megatron-core's `MultiTokenPredictionLayer`: norms of the next token's embedding
    and of the hidden state, the projection of both (2h -> h, column-parallel, no bias), a
    transformer layer built from the last decoder layer's spec (dense or MoE as that layer), and its
    final norm. The embedding and output layer are the model's."""
    h, nb = inp.hidden, inp.norm_has_bias
    named = _norm(f"{prefix}enorm", h, nb) + _norm(f"{prefix}hnorm", h, nb)
    out = [Param(n, k, False, False) for n, k in named]
    out.append(Param(f"{prefix}eh_proj.weight", h // inp.tp * 2 * h, False, False, fp8=inp.fp8_params))
    layer = _layer_template(inp, inp.moe_layer_pattern[-1])
    out += [p._replace(name=f"{prefix}transformer_layer.{p.name}") for p in layer]
    out += [Param(n, k, False, False) for n, k in _norm(f"{prefix}final_layernorm", h, nb)]
    return out
