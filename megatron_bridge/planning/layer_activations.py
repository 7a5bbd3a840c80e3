"""Activation memory of one transformer layer: what the backward pass keeps per micro batch.

The per-layer accounting follows Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022): every tensor a layer saves for its backward pass, counted by who
saves it. For the architecture that paper assumes (multi-head attention, a 4h GeLU MLP, dropout,
LayerNorm, no rotary embedding, 16-bit activations and softmax) the sum reduces to its closed
forms, in bytes per layer for sequence s, micro batch b, width h, heads a, tensor-parallel size t
(plus the per-token norm statistics the paper leaves out):

    no recompute             sbh (10 + 24/t + 5as/(ht))     with sequence parallel  sbh/t (34 + 5as/h)
    selective (core attn)    sbh (10 + 24/t)                with sequence parallel  34 sbh/t
    full (each layer)        2 sbh                          with sequence parallel  2 sbh/t

The general form below covers what megatron-core's layers really keep: grouped-query attention
(the QKV projection's output stays alive as the storage of K and V, Q and K are new tensors after
the rotary embedding, which keeps its cos/sin tables), gated MLPs (without the fused
bias-activation kernel the SiLU output and a copy of the up projection are kept too), the core
attention (`core_attention.py`: unfused scores, SDPA, TransformerEngine), the norms a layer has
(before attention and MLP or not, after them, qk-norm per head or over whole projections),
mixture-of-experts layers with shared experts, LoRA/DoRA adapters (`adapters.py`), context and
sequence parallelism and megatron-core's selective recompute modules.
`tests/test_planner_activations.py` compares it with the tensors autograd saves for one layer.
Multi-latent attention keeps its latents and their norms' outputs, the up-projected Q, K and V
(unless `mla_up_proj` is recomputed; that case is counted, not measured) and the value-width
output projection input.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from megatron_bridge.planning import core_attention
from megatron_bridge.planning.adapters import activation_terms as adapter_terms
from megatron_bridge.planning.inputs import PlanInputs

MLP_BLOCK = (
    "MLP norm input", "MLP norm statistics (fp32 per token)", "MLP input", "activation input",
    "SiLU output of the gate", "up projection copy (x + glu_linear_offset)", "second MLP projection input",
    "router logits and probabilities", "dispatched tokens", "expert activation input",
    "expert SiLU outputs and up-projection copies", "expert second projection input", "combined expert outputs",
    "shared expert activations", "MLP output norm input", "MLP output norm statistics (fp32 per token)",
    "MLP residual dropout mask", "attention output norm input", "attention output norm statistics (fp32 per token)",
    "output projection input",
)  # fmt: skip
"""Terms of a layer freed before its core attention's backward (that runs after the MLP's)."""


def _selective(inp: PlanInputs, module: str) -> bool:
    return inp.recompute_granularity == "selective" and module in inp.recompute_modules


def norm_stats(inp: PlanInputs) -> int:
    """fp32 bytes per token a norm keeps besides its input: mean and 1/std (LayerNorm) or 1/rms."""
    return 8 if inp.norm_has_bias else 4


def _output_norm(inp: PlanInputs, block: str, s: float, b: int, add) -> None:
    """A norm after attention or the MLP (`output_layernorms`) keeps the projection's output, its
    input; a local norm also its statistics."""
    sp = inp.tp if inp.sequence_parallel else 1
    add(f"{block} output norm input", inp.activation_bytes * s * b * inp.hidden / sp)
    if not inp.transformer_engine:
        add(f"{block} output norm statistics (fp32 per token)", norm_stats(inp) * s * b / sp)


def _projection_norm_terms(inp: PlanInputs, s: float, b: int) -> dict[str, float]:
    """What the qk-norm over whole projections (`ProjectionNorm`, `qk_layernorm_per_head=False`)
    keeps for Q and K: the fp32 copy of its input (with 16-bit activations; in fp32 it keeps the
    input itself, one of the storages of Q and K), its normalized fp32 output, which the gradient
    of its weight reads (not kept when the weight is frozen, as with PEFT), and one fp32 1/rms per
    token for Q and one for K, over all heads (the same on every tensor-parallel rank)."""
    width = (inp.heads + inp.query_groups) * inp.kv_channels / inp.tp
    terms: dict[str, float] = {}
    if inp.activation_bytes < 4:
        terms["Q, K in fp32 (whole-projection norm input)"] = 4 * s * b * width
    if inp.peft is None:
        terms["Q, K normalized in fp32 (whole-projection norm)"] = 4 * s * b * width
    terms["Q, K norm statistics (fp32 per token)"] = 2 * 4 * s * b
    return terms


def _mla_terms(
    inp: PlanInputs, s: float, b: int, q_up_input: bool = True, kv_up_input: bool = True
) -> dict[str, float]:
    """What multi-latent attention keeps between its input and its core attention: the latents
    (down-projection outputs, the inputs of their norms) and the norms' outputs (the inputs of the
    up projections, kept where `q_up_input` / `kv_up_input`: with PEFT only for adapted up
    projections), whole on every tensor-parallel rank, with local layers' norm statistics and
    rotary tables; and the up-projected Q, K (rope parts joined on) and V this rank's heads hand
    to the core attention, unless `mla_up_proj` is recomputed from the latents in backward."""
    e, t = inp.activation_bytes, inp.tp
    q_width = inp.heads * (inp.qk_head_dim + inp.qk_rope_dim)
    v_width = inp.heads * inp.v_head_dim
    latents = (1 + q_up_input) * inp.q_lora_rank + (1 + kv_up_input) * inp.kv_lora_rank + inp.qk_rope_dim
    terms = {"query and key/value latents and their norm outputs": e * s * b * latents}
    if not inp.transformer_engine:
        norms = 2 if inp.q_lora_rank else 1
        terms["latent norm statistics (fp32 per token)"] = norms * norm_stats(inp) * s * b
        # cos and sin for the rope parts of Q and of K, as the grouped-query layers keep them
        terms["rotary cos/sin tables"] = 4 * e * s * inp.qk_rope_dim
    if not _selective(inp, "mla_up_proj"):
        terms["Q, K, V"] = e * s * b * (2 * q_width + v_width) / t
    return terms


@lru_cache(maxsize=1024)
def layer_terms(
    inp: PlanInputs,
    moe: bool = False,
    micro_batch: Optional[int] = None,
    masked: bool = False,
    adapted: tuple[str, ...] = (),
) -> dict[str, float]:
    """Bytes one transformer layer keeps for backward, per micro batch, on one rank, without full
    recompute; by tensor (zero-byte terms left out). `masked`: a mask tensor reaches its core
    attention; `adapted`: its LoRA/DoRA-adapted linear layers."""
    s = inp.seq_length / inp.cp
    b = micro_batch if micro_batch is not None else inp.micro_batch_size
    h, t, e = inp.hidden, inp.tp, inp.activation_bytes
    sp = t if inp.sequence_parallel else 1  # tensors outside the TP region are split only with SP
    sbh = s * b * h
    d = inp.kv_channels
    q_width, kv_width = inp.heads * d, inp.query_groups * d
    local = not inp.transformer_engine
    terms: dict[str, float] = {}

    def add(name: str, value: float) -> None:
        if value:
            terms[name] = terms.get(name, 0.0) + value

    def input_kept(*linears: str) -> bool:
        """The input of these linear layers is kept for a weight gradient: with PEFT a frozen layer
        keeps none (megatron-core's LinearWithFrozenWeight), an adapted one keeps it for its
        adapter's A, unless the adapter's dropout acts on the input (A then keeps the dropped copy)."""
        if inp.peft is None:
            return True
        if inp.peft_dropout > 0 and inp.peft_dropout_position == "pre":
            return False
        return any(rel.endswith(linear) for rel in adapted for linear in linears)

    # --- attention block
    norms_recomputed = _selective(inp, "layernorm") and inp.input_norms  # megatron-core skips identity norms
    if inp.input_norms:
        add("attention norm input", e * sbh / sp)
        if local:
            add("attention norm statistics (fp32 per token)", norm_stats(inp) * s * b / sp)
    attention_inputs = ("linear_q_proj", "linear_q_down_proj", "linear_kv_down_proj") if inp.mla else ("linear_qkv",)
    if not norms_recomputed and input_kept(*attention_inputs):
        add("QKV projection input", e * sbh / sp)
    if inp.mla:
        up_inputs = input_kept("linear_q_up_proj"), input_kept("linear_kv_up_proj")
        for name, value in _mla_terms(inp, s, b, *up_inputs).items():
            add(name, value)
    elif not local:
        add("Q, K, V", e * s * b * (q_width + 2 * kv_width) / t)
    else:
        for name, value in core_attention.input_terms(inp, s, b, masked).items():
            add(name, value)
        if inp.rotary_dim:
            add("rotary cos/sin tables", 4 * e * s * inp.rotary_dim)
        if inp.qk_layernorm and inp.qk_norm_per_head:
            add("Q, K norm statistics (fp32)", norm_stats(inp) * s * b * (inp.heads + inp.query_groups) / t)
    if inp.qk_layernorm and not inp.qk_norm_per_head and not inp.mla:
        for name, value in _projection_norm_terms(inp, s, b).items():
            add(name, value)
    for name, value in core_attention.saved_terms(inp, s, b, masked).items():
        add(name, value)
    if input_kept("linear_proj") or inp.core_attention == "sdpa":  # SDPA keeps its output, the same storage
        add("output projection input", e * s * b * (inp.heads * inp.v_head_dim if inp.mla else q_width) / t)
    if inp.output_norms:
        _output_norm(inp, "attention", s, b, add)
    if inp.hidden_dropout > 0:
        add("attention residual dropout mask", sbh / sp)

    # --- MLP block
    if inp.input_norms:
        add("MLP norm input", e * sbh / sp)
        if local:
            add("MLP norm statistics (fp32 per token)", norm_stats(inp) * s * b / sp)
    gated = 2 if inp.gated else 1
    unfused_glu = inp.gated and not inp.activation_fused  # keeps SiLU(gate) and a copy of the up half too
    if not norms_recomputed and (moe or input_kept("mlp.linear_fc1")):
        add("MLP input", e * sbh / sp)
    if not moe:
        if not _selective(inp, "mlp"):
            add("activation input", e * s * b * inp.ffn * gated / t)
            if unfused_glu:
                add("SiLU output of the gate", e * s * b * inp.ffn / t)
                add("up projection copy (x + glu_linear_offset)", e * s * b * inp.ffn / t)
            if input_kept("mlp.linear_fc2"):
                add("second MLP projection input", e * s * b * inp.ffn / t)
    else:
        # Tokens spread evenly over the experts: each rank's experts see topk x its tokens.
        tokens = s * b * inp.topk
        add("router logits and probabilities", 2 * 4 * s * b * inp.num_experts)
        if not _selective(inp, "moe"):
            add("dispatched tokens", e * tokens * h)
            if not _selective(inp, "moe_act"):
                add("expert activation input", e * tokens * inp.moe_ffn * gated / inp.etp)
                if unfused_glu:
                    add("expert SiLU outputs and up-projection copies", 2 * e * tokens * inp.moe_ffn / inp.etp)
            add("expert second projection input", e * tokens * inp.moe_ffn / inp.etp)
            add("combined expert outputs", e * tokens * h)
        if inp.shared_expert_ffn and not _selective(inp, "shared_experts"):
            kept = gated + 1 + (2 if unfused_glu else 0)
            add("shared expert activations", e * s * b * inp.shared_expert_ffn * kept / t)
    if inp.output_norms:
        _output_norm(inp, "MLP", s, b, add)
    if inp.hidden_dropout > 0:
        add("MLP residual dropout mask", sbh / sp)
    for name, value in adapter_terms(inp, adapted, s, b).items():
        add(name, value)
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
