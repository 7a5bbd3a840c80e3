"""Memory of the core attention (scores, softmax, dropout, weighted sum) of one layer.

Three implementations, as `megatron_bridge.models.attention.core_attention_choice` picks them:

* **unfused**: megatron-core's local `DotProductAttention` materializes the scores
  [b, heads/TP, s, s]. With 16-bit activations and `attention_softmax_in_fp32` (the default) one
  layer's forward creates, per score element: the scores (16-bit, from `baddbmm`), their fp32
  copy (the mask is applied to it in place), the fp32 softmax output, and its 16-bit copy that
  multiplies the values. Autograd keeps the fp32 softmax output (softmax's backward reads it)
  and the 16-bit copy (the input of `bmm`); with attention dropout, its mask (1 byte) and output
  instead of the 16-bit copy; and the [s, s] boolean causal mask each layer builds. The backward
  of the softmax holds three fp32 planes at once: the saved output, the incoming gradient and the
  outgoing one. megatron-core also allocates one 16-bit plane as the `input` of the `baddbmm`
  (its global memory buffer) at the first step and keeps it for the run.
  Selective recompute of `core_attn` keeps none of this per layer: the layer's scores exist only
  while its backward runs, so one layer's worth is the working set at the peak.
* **sdpa**: `torch.nn.functional.scaled_dot_product_attention` with the flash or
  memory-efficient kernels of a GPU keeps Q, K, V (counted with the layer), the output (the
  output projection's input) and one fp32 log-sum-exp per head and token: no s^2 term. A mask
  tensor (sliding window, packed samples) is kept as a 16-bit additive bias by the
  memory-efficient kernel, which also needs K and V repeated to every head. The planner plans
  this GPU path; torch's CPU flash kernel keeps the same tensors, its math path (taken with
  masks or dropout on CPU) keeps the s^2 probabilities.
* **te**: TransformerEngine's fused attention keeps the softmax statistics (as planned before
  TE layers were told apart from local ones; not measured here).
"""

from __future__ import annotations

from megatron_bridge.planning.inputs import PlanInputs

Terms = dict[str, float]


def _add(terms: Terms, name: str, value: float) -> None:
    if value:
        terms[name] = terms.get(name, 0.0) + value


def recomputed(inp: PlanInputs) -> bool:
    """Selective recompute of the core attention: its backward runs its forward again."""
    return inp.recompute_granularity == "selective" and "core_attn" in inp.recompute_modules


def _score_elements(inp: PlanInputs, s: float, b: int) -> float:
    """Score elements of one layer on one rank: b x heads/TP x s x keys (every key with context
    parallelism)."""
    return b * inp.heads / inp.tp * s * inp.seq_length


def _softmax_bytes(inp: PlanInputs) -> int:
    """Bytes per element of the softmax (fp32 when asked for with 16-bit activations)."""
    e = inp.activation_bytes
    return 4 if (e < 4 and inp.softmax_in_fp32) else e


def _unfused_saved(inp: PlanInputs) -> Terms:
    """Bytes per score element that one layer keeps for backward (no recompute)."""
    e, f = inp.activation_bytes, _softmax_bytes(inp)
    terms: Terms = {}
    _add(terms, f"attention softmax output ({'fp32' if f == 4 else f'{8 * f}-bit'})", f)
    if inp.attention_dropout > 0:
        _add(terms, "attention dropout mask", 1)
        _add(terms, "attention dropout output", e)
    elif f != e:
        _add(terms, f"attention probabilities ({8 * e}-bit copy)", e)
    return terms


def _unfused_peak_alive(inp: PlanInputs) -> float:
    """Bytes per score element alive at the worst moment of one layer's core attention."""
    e, f = inp.activation_bytes, _softmax_bytes(inp)
    cast = f != e
    forward = e + f * cast + f + e * cast  # scores, fp32 copy, softmax output, 16-bit copy
    if inp.attention_dropout > 0:  # after the fp32 copy is gone: + dropout output and mask
        forward = max(forward, e + f + e * cast + e + 1)
    backward = 3 * f  # softmax backward: saved output, incoming and outgoing gradient
    return max(forward, backward)


def saved_terms(inp: PlanInputs, s: float, b: int, masked: bool) -> Terms:
    """What one layer's core attention keeps for backward (none of it with selective recompute
    of core_attn: its inputs are the layer's Q, K, V)."""
    if recomputed(inp):
        return {}
    return _kept(inp, s, b, masked)


def _repeats_kv(inp: PlanInputs, masked: bool) -> bool:
    """The core attention repeats K and V to every query head (grouped-query attention): the
    unfused path always, SDPA where a mask sends it to the memory-efficient kernel."""
    gqa = inp.query_groups < inp.heads
    return gqa and (inp.core_attention == "unfused" or (inp.core_attention == "sdpa" and masked))


def input_terms(inp: PlanInputs, s: float, b: int, masked: bool) -> Terms:
    """The storages of Q, K and V that stay alive for backward in megatron-core's local layers.

    The QKV projection's output is split into views; Q becomes a copy when grouped-query heads
    are reshaped, Q and K new tensors after the rotary embedding (or QK norms); V stays a view of
    the projection's output. A checkpoint of the core attention (selective recompute) and SDPA
    keep Q, K, V as they arrive; the unfused path (and SDPA with a mask) keeps K and V repeated to
    every query head instead of the originals."""
    e, t = inp.activation_bytes, inp.tp
    q, kv = inp.heads * inp.kv_channels, inp.query_groups * inp.kv_channels
    gqa = inp.query_groups < inp.heads
    mixed = "QKV projection output (K and V are views of it)"
    widths: dict[str, float] = {mixed: q + 2 * kv}
    if inp.rotary_dim:
        q_store, k_store = "Q after the rotary embedding", "K after the rotary embedding"
    elif inp.qk_layernorm:
        q_store, k_store = "Q after its norm", "K after its norm"
    else:
        q_store, k_store = ("Q (reshaped copy)" if gqa else mixed), mixed
    widths.setdefault(q_store, q)
    widths.setdefault(k_store, kv)
    selective = recomputed(inp)
    kept = {q_store, k_store, mixed}
    if _repeats_kv(inp, masked) and not selective:
        kept = {q_store, "K, V repeated to every head"}
        widths["K, V repeated to every head"] = 2 * q
    # the norms keep their inputs: Q (a copy with GQA) and K (a view); the whole-projection norm
    # keeps fp32 copies instead, except when the activations are fp32 already
    if inp.qk_layernorm and (inp.qk_norm_per_head or e >= 4):
        kept |= {mixed} | ({"Q before its norm (reshaped copy)"} if gqa else set())
        widths["Q before its norm (reshaped copy)"] = q
    return {name: e * s * b * widths[name] / t for name in widths if name in kept}


def _kept(inp: PlanInputs, s: float, b: int, masked: bool) -> Terms:
    e = inp.activation_bytes
    a_local = inp.heads / inp.tp
    terms: Terms = {}
    if inp.core_attention == "unfused":
        n = _score_elements(inp, s, b)
        for name, per_element in _unfused_saved(inp).items():
            _add(terms, name, per_element * n)
        # megatron-core builds its [s, s] boolean mask in every layer; masked_fill keeps it
        _add(terms, "causal mask (built by each layer)", s * inp.seq_length)
    elif inp.core_attention == "sdpa":
        _add(terms, "attention log-sum-exp (fp32)", 4 * a_local * s * b)
        if masked:
            planes = b if inp.mask_per_sample else 1
            _add(terms, "attention mask as a 16-bit bias (memory-efficient kernel)", e * planes * s * inp.seq_length)
    else:
        _add(terms, "attention softmax statistics", 4 * a_local * s * b)
    return terms


def working_set(inp: PlanInputs, s: float, b: int, masked: bool) -> Terms:
    """What one layer's core attention adds at its worst moment in backward, beyond what the
    layer keeps for backward: the score planes of unfused attention (all of them when they are
    recomputed), the recomputed tensors of other kinds."""
    selective = recomputed(inp)
    terms: Terms = {}
    if inp.core_attention == "te":
        return terms  # not modeled for TransformerEngine's kernels
    if inp.core_attention == "unfused":
        n = _score_elements(inp, s, b)
        alive = _unfused_peak_alive(inp)
        kept = 0.0 if selective else sum(_unfused_saved(inp).values())
        _add(terms, "attention score planes in the core attention's backward", (alive - kept) * n)
    if selective:  # recomputed: what the layer otherwise keeps
        if inp.core_attention != "unfused":
            for name, value in _kept(inp, s, b, masked).items():
                _add(terms, f"{name} (recomputed)", value)
        if _repeats_kv(inp, masked):
            q = inp.heads * inp.kv_channels
            _add(terms, "K, V repeated to every head (recomputed)", 2 * inp.activation_bytes * s * b * q / inp.tp)
    return terms


def persistent(inp: PlanInputs, s: float, b: int) -> Terms:
    """Buffers the core attention allocates once and keeps: the score-sized `baddbmm` input of
    unfused attention (megatron-core's global memory buffer)."""
    if inp.core_attention != "unfused":
        return {}
    plane = inp.activation_bytes * _score_elements(inp, s, b)
    return {"attention score buffer (megatron-core's global memory buffer)": plane}


def describe(inp: PlanInputs) -> str:
    """A few words on what the core attention keeps, for the plan's activation row."""
    if inp.core_attention == "unfused":
        return f"unfused attention (scores {'recomputed per layer' if recomputed(inp) else 'kept'})"
    if inp.core_attention == "sdpa":
        return "SDPA attention (no scores kept)"
    return "fused attention"
