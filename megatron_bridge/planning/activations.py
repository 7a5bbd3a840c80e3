"""Activation memory: what the backward pass keeps per layer, per micro batch, and how many micro
batches a pipeline stage holds at once.

The per-layer accounting follows Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022): every tensor a layer saves for its backward pass, counted by who
saves it. For the architecture that paper assumes (multi-head attention, a 4h GeLU MLP, dropout,
LayerNorm, attention scores materialized, 16-bit activations) the sum reduces to its closed forms,
in bytes per layer for sequence s, micro batch b, width h, heads a, tensor-parallel size t:

    no recompute             sbh (10 + 24/t + 5as/(ht))     with sequence parallel  sbh/t (34 + 5as/h)
    selective (core attn)    sbh (10 + 24/t)                with sequence parallel  34 sbh/t
    full (each layer)        2 sbh                          with sequence parallel  2 sbh/t

The general form below covers grouped-query attention, multi-latent attention (its query and
key/value latents, and the up-projected heads unless `mla_up_proj` is recomputed), gated MLPs,
no dropout, RMSNorm, fused (flash) attention, mixture-of-experts layers with shared experts,
context parallelism and megatron-core's selective recompute modules. The tests check it against the closed forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from megatron_bridge.planning.inputs import PlanInputs
from megatron_bridge.planning.params import Chunk


def _selective(inp: PlanInputs, module: str) -> bool:
    return inp.recompute_granularity == "selective" and module in inp.recompute_modules


@lru_cache(maxsize=512)
def layer_terms(inp: PlanInputs, moe: bool = False, micro_batch: Optional[int] = None) -> dict[str, float]:
    """Bytes one transformer layer keeps for backward, per micro batch, on one rank, without full
    recompute; by tensor (zero-byte terms left out)."""
    s = inp.seq_length / inp.cp
    b = micro_batch if micro_batch is not None else inp.micro_batch_size
    h, t, e = inp.hidden, inp.tp, inp.activation_bytes
    sp = t if inp.sequence_parallel else 1  # tensors outside the TP region are split only with SP
    sbh = s * b * h
    q_width = inp.heads * inp.kv_channels
    kv_width = inp.query_groups * inp.kv_channels
    a_local = inp.heads / t
    terms: dict[str, float] = {}

    def add(name: str, value: float) -> None:
        if value:
            terms[name] = terms.get(name, 0.0) + value

    # --- attention block
    if inp.input_norms:
        add("attention norm input", e * sbh / sp)
    if not _selective(inp, "layernorm"):
        add("QKV projection input", e * sbh / sp)
    if inp.mla:
        q_head = inp.qk_head_dim + inp.qk_rope_dim
        q_width, v_width = inp.heads * q_head, inp.heads * inp.v_head_dim
        # the latents (down-projection outputs and norm outputs) are whole on every rank
        if inp.q_lora_rank:
            add("query latent and its norm output", 2 * e * s * b * inp.q_lora_rank)
        add("key/value latent and its norm output", e * s * b * (2 * inp.kv_lora_rank + inp.qk_rope_dim))
        if not _selective(inp, "mla_up_proj"):  # recomputed from the latents in backward
            add("Q, K, V", e * s * b * (2 * q_width + v_width) / t)
    else:
        add("Q, K, V", e * s * b * (q_width + 2 * kv_width) / t)
    if not _selective(inp, "core_attn"):
        if inp.transformer_engine:  # fused (flash) attention keeps only the softmax statistics
            add("attention softmax statistics", 4 * a_local * s * b)
        else:
            keys = inp.seq_length  # with context parallelism each query chunk sees every key
            add("attention softmax output", e * a_local * s * keys * b)
            if inp.attention_dropout > 0:
                add("attention dropout mask", a_local * s * keys * b)
                add("attention dropout output", e * a_local * s * keys * b)
    add("output projection input", e * s * b * (inp.heads * inp.v_head_dim if inp.mla else q_width) / t)
    if inp.output_norms:
        add("attention output norm input", e * sbh / sp)
    if inp.hidden_dropout > 0:
        add("attention residual dropout mask", sbh / sp)

    # --- MLP block
    if inp.input_norms:
        add("MLP norm input", e * sbh / sp)
    gated = 2 if inp.gated else 1
    if not moe:
        if not _selective(inp, "layernorm"):
            add("MLP input", e * sbh / sp)
        if not _selective(inp, "mlp"):
            add("activation input", e * s * b * inp.ffn * gated / t)
            add("second MLP projection input", e * s * b * inp.ffn / t)
    else:
        # Tokens spread evenly over the experts: each rank's experts see topk x its tokens.
        tokens = s * b * inp.topk
        if not _selective(inp, "layernorm"):
            add("MLP input", e * sbh / sp)
        add("router logits and probabilities", 2 * 4 * s * b * inp.num_experts)
        if not _selective(inp, "moe"):
            add("dispatched tokens", e * tokens * h)
            if not _selective(inp, "moe_act"):
                add("expert activation input", e * tokens * inp.moe_ffn * gated / inp.etp)
            add("expert second projection input", e * tokens * inp.moe_ffn / inp.etp)
            add("combined expert outputs", e * tokens * h)
        if inp.shared_expert_ffn and not _selective(inp, "shared_experts"):
            add("shared expert activations", e * s * b * inp.shared_expert_ffn * (gated + 1) / t)
    if inp.output_norms:
        add("MLP output norm input", e * sbh / sp)
    if inp.hidden_dropout > 0:
        add("MLP residual dropout mask", sbh / sp)
    return terms


def layer_bytes(inp: PlanInputs, moe: bool = False) -> float:
    """Bytes one layer keeps per micro batch with the config's recompute setting; with full
    recompute, the layer input only (the checkpoint of one recompute unit, shared by its layers)."""
    if inp.recompute_granularity == "full":
        return layer_input_bytes(inp)
    return sum(layer_terms(inp, moe).values())


def layer_input_bytes(inp: PlanInputs) -> float:
    """A layer's input, which full recompute keeps (split over TP with sequence parallelism)."""
    s = inp.seq_length / inp.cp
    return inp.activation_bytes * s * inp.micro_batch_size * inp.hidden / (inp.tp if inp.sequence_parallel else 1)


@dataclass
class StageActivations:
    """Activation bytes of one pipeline rank."""

    per_micro_batch: float
    """All layers and extras of this rank for one micro batch (all of its model chunks)."""
    in_flight: float
    """Micro batches whose activations are held at the peak (in units of whole micro batches)."""
    output_layer: float
    """Logits and loss of the last stage (held for one micro batch at a time)."""
    recompute_working_set: float
    """One recompute unit recomputed during backward (full recompute)."""

    @property
    def total(self) -> float:
        return self.per_micro_batch * self.in_flight + self.output_layer + self.recompute_working_set


def chunk_bytes(inp: PlanInputs, chunk: Chunk) -> float:
    """Activations of one model chunk per micro batch (without the logits)."""
    s = inp.seq_length / inp.cp
    b, h, e = inp.micro_batch_size, inp.hidden, inp.activation_bytes
    sp = inp.tp if inp.sequence_parallel else 1
    layers = range(chunk.first_layer, chunk.first_layer + chunk.num_layers)
    pattern = inp.moe_layer_pattern
    if inp.recompute_granularity == "full":
        n = inp.recompute_num_layers or 1
        if inp.recompute_method == "block":
            # the first n layers of the chunk keep their input only, the rest everything
            total = sum(
                layer_input_bytes(inp) if i < n else sum(layer_terms(inp, pattern[j]).values())
                for i, j in enumerate(layers)
            )
        else:
            units = -(-chunk.num_layers // n)
            total = units * layer_input_bytes(inp)
    else:
        moe_layers = sum(pattern[chunk.first_layer : chunk.first_layer + chunk.num_layers])
        total = (chunk.num_layers - moe_layers) * layer_bytes(inp, False) + moe_layers * layer_bytes(inp, True)
    if chunk.pre_process and inp.hidden_dropout > 0:
        total += s * b * h / sp  # embedding dropout mask
    if chunk.post_process:
        total += 2 * e * s * b * h / sp  # final norm input, output layer input
    return total


def in_flight_micro_batches(inp: PlanInputs, pp_rank: int) -> float:
    """Micro batches whose activations a pipeline rank holds at its peak, as megatron-core's 1F1B
    schedules warm up: p - rank without interleaving; with v virtual stages,
    (2 (p - rank - 1) + (v - 1) g + 1) chunks of 1/v of the stage (g: micro batches per virtual
    stage group, p by default)."""
    m = inp.num_microbatches
    if inp.pp == 1:
        return 1.0
    if not inp.vp:
        return float(min(inp.pp - pp_rank, m))
    g = inp.microbatch_group_size or inp.pp
    chunks = min(2 * (inp.pp - pp_rank - 1) + (inp.vp - 1) * g + 1, m * inp.vp)
    return chunks / inp.vp


def stage_activations(inp: PlanInputs, stage: list[Chunk]) -> StageActivations:
    """Peak activation bytes of the pipeline rank holding `stage` (its model chunks)."""
    s = inp.seq_length / inp.cp
    b = inp.micro_batch_size
    per_mb = sum(chunk_bytes(inp, c) for c in stage)
    logits = 0.0
    if any(c.post_process for c in stage):
        logits = 4 * s * b * inp.padded_vocab / inp.tp  # fp32 logits of the cross entropy
    working = 0.0
    if inp.recompute_granularity == "full":
        unit = 1 if inp.recompute_method == "block" else (inp.recompute_num_layers or 1)
        moe_any = any(inp.moe_layer_pattern)
        working = unit * sum(layer_terms(inp, moe_any).values())
    return StageActivations(per_mb, in_flight_micro_batches(inp, stage[0].pp_rank), logits, working)
