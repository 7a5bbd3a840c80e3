"""Activation memory of a pipeline stage: how many micro batches it holds, what each keeps
(per layer: `layer_activations.py`; the multi-token-prediction depths on the last stage:
`mtp.py`), and the working set on top of them at the stage's peak.

At the peak a stage holds the saved tensors of its micro batches in flight, buffers kept for the
whole run, and one working set: the largest of the transient tensors of the cross entropy (the
logits, 16-bit and fp32) and of the backward of the last layer's core attention (for unfused
attention, the score planes), together with what is alive at that moment (the tied output-layer
weight gradient waits in autograd until the embedding's backward) and less what is already freed
(the last layer's MLP block). With TransformerEngine layers the stage total is as it was planned
before local layers were told apart (fp32 logits, one recomputed unit), not measured here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import repeat

from megatron_bridge.planning import core_attention, mtp
from megatron_bridge.planning.adapters import local_adapted
from megatron_bridge.planning.inputs import PlanInputs
from megatron_bridge.planning.layer_activations import (  # noqa: F401 (layer_bytes: this module's API too)
    MLP_BLOCK,
    layer_bytes,
    layer_input_bytes,
    layer_terms,
)
from megatron_bridge.planning.params import Chunk


def _kind(inp: PlanInputs, layer: int) -> tuple[bool, bool, tuple[str, ...]]:
    """What makes layers keep different tensors: MoE or dense, a mask, the adapters."""
    return inp.moe_layer_pattern[layer], inp.attention_masks[layer], local_adapted(inp, layer)


def _terms_of(inp: PlanInputs, layer: int) -> dict[str, float]:
    """`layer_terms` of global layer `layer` (its kind, mask and adapters)."""
    moe, masked, adapted = _kind(inp, layer)
    return layer_terms(inp, moe, None, masked, adapted)


def _layers_bytes(inp: PlanInputs, layers: range) -> float:
    """Sum of `layer_terms` over `layers`, one lookup per kind of layer."""
    lo, hi = layers.start, layers.stop
    adapters = (local_adapted(inp, j) for j in layers) if inp.peft else repeat(())
    kinds = Counter(zip(inp.moe_layer_pattern[lo:hi], inp.attention_masks[lo:hi], adapters))
    return sum(
        n * sum(layer_terms(inp, moe, None, masked, adapted).values()) for (moe, masked, adapted), n in kinds.items()
    )


@dataclass
class StageActivations:
    """Activation bytes of one pipeline rank at its peak."""

    per_micro_batch: float
    """All layers and extras of this rank for one micro batch (all of its model chunks)."""
    in_flight: float
    """Micro batches whose activations are held at the peak (in units of whole micro batches)."""
    working: dict[str, float] = field(default_factory=dict)
    """The transient tensors at the peak moment, by tensor (a negative term: freed by then)."""
    moment: str = ""
    """When the peak happens."""
    buffers: dict[str, float] = field(default_factory=dict)
    """Buffers allocated once and kept for the run."""

    @property
    def working_bytes(self) -> float:
        return sum(self.working.values())

    @property
    def buffer_bytes(self) -> float:
        return sum(self.buffers.values())

    @property
    def total(self) -> float:
        return self.per_micro_batch * self.in_flight + self.working_bytes + self.buffer_bytes


def chunk_bytes(inp: PlanInputs, chunk: Chunk) -> float:
    """Activations of one model chunk per micro batch (without the logits)."""
    s = inp.seq_length / inp.cp
    b, h, e = inp.micro_batch_size, inp.hidden, inp.activation_bytes
    sp = inp.tp if inp.sequence_parallel else 1
    layers = range(chunk.first_layer, chunk.first_layer + chunk.num_layers)
    if inp.recompute_granularity == "full":
        n = inp.recompute_num_layers or 1
        if inp.recompute_method == "block":
            # the first n layers of the chunk keep their input only, the rest everything
            kept = range(chunk.first_layer + min(n, chunk.num_layers), chunk.first_layer + chunk.num_layers)
            total = min(n, chunk.num_layers) * layer_input_bytes(inp) + _layers_bytes(inp, kept)
        else:
            units = -(-chunk.num_layers // n)
            total = units * layer_input_bytes(inp)
    else:
        total = _layers_bytes(inp, layers)
    if chunk.pre_process and inp.hidden_dropout > 0:
        total += s * b * h / sp  # embedding dropout mask
    if chunk.post_process:  # final norm input, output layer input (not kept when it is frozen)
        total += (2 if inp.peft is None else 1) * e * s * b * h / sp
        total += mtp.mtp_bytes(inp)
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


def _recompute_unit(inp: PlanInputs) -> int:
    return 1 if inp.recompute_method == "block" else (inp.recompute_num_layers or 1)


def _te_working(inp: PlanInputs, stage: list[Chunk]) -> tuple[dict[str, float], str]:
    """TransformerEngine layers: fp32 logits on the last stage, plus one recomputed unit."""
    s, b = inp.seq_length / inp.cp, inp.micro_batch_size
    working: dict[str, float] = {}
    moments = []
    if any(c.post_process for c in stage):
        working["logits in fp32 (cross entropy)"] = 4 * s * b * inp.padded_vocab / inp.tp
        moments.append("cross entropy")
    if inp.recompute_granularity == "full":
        moe_any = any(inp.moe_layer_pattern)
        working["recomputed layers"] = _recompute_unit(inp) * sum(layer_terms(inp, moe_any).values())
        moments.append("a recomputed unit")
    return working, " and ".join(moments)


def _moments(inp: PlanInputs, stage: list[Chunk]) -> dict[str, dict[str, float]]:
    """The transient tensors of each candidate peak moment of a stage of local layers."""
    s, b, e = inp.seq_length / inp.cp, inp.micro_batch_size, inp.activation_bytes
    vocab = s * b * inp.padded_vocab / inp.tp
    moments: dict[str, dict[str, float]] = {}
    last_chunk = stage[-1]
    if any(c.post_process for c in stage):
        if e < 4:
            moments["cross entropy"] = {f"logits ({8 * e}-bit)": e * vocab, "logits in fp32 (cross entropy)": 4 * vocab}
            if inp.mtp_depths:  # megatron-core's loop over the depths keeps the last one's in scope
                moments["cross entropy"][f"last MTP depth's logits ({8 * e}-bit, still referenced)"] = e * vocab
        else:
            moments["cross entropy"] = {"logits (fp32)": 4 * vocab}
    tied_grad = 0.0
    holds_both = any(c.pre_process for c in stage) and any(c.post_process for c in stage)
    if inp.tied_embeddings and holds_both and not inp.wgrad_fusion and inp.peft is None:
        tied_grad = inp.param_bytes * inp.padded_vocab / inp.tp * inp.hidden
        moments["output layer backward"] = {
            f"logits gradient ({8 * e}-bit)": e * vocab,
            "output-layer weight gradient (tied; held until the embedding's backward)": tied_grad,
        }
    if last_chunk.num_layers == 0:
        return moments
    last = last_chunk.first_layer + last_chunk.num_layers - 1
    kept = _terms_of(inp, last)
    core = core_attention.working_set(inp, s, b, inp.attention_masks[last])
    moment: dict[str, float] = {}
    if inp.recompute_granularity == "full":
        unit = min(_recompute_unit(inp), last_chunk.num_layers)
        recomputed = sum(sum(_terms_of(inp, j).values()) for j in range(last - unit + 1, last + 1))
        moment["layers recomputed for their backward"] = recomputed
    moment.update(core)
    if tied_grad:
        moment["output-layer weight gradient (tied; held until the embedding's backward)"] = tied_grad
    freed = sum(v for k, v in kept.items() if k in MLP_BLOCK)
    if freed and (core or inp.recompute_granularity == "full"):
        moment["last layer's MLP block and output-projection input (freed by then)"] = -freed
    depths = mtp.mtp_bytes(inp) if last_chunk.post_process else 0.0
    if depths and (core or tied_grad):  # their backward runs before the decoder's
        moment["multi-token prediction depths (freed by then)"] = -depths
    if depths and core_attention.working_set(inp, s, b, inp.mtp_masks[-1]):
        moments["core attention backward of the last MTP depth"] = mtp.last_depth_moment(inp, s, b, tied_grad)
    if core or tied_grad:
        moments["core attention backward of the last layer"] = moment
    return moments


def stage_activations(inp: PlanInputs, stage: list[Chunk]) -> StageActivations:
    """Peak activation bytes of the pipeline rank holding `stage` (its model chunks)."""
    per_mb = sum(chunk_bytes(inp, c) for c in stage)
    in_flight = in_flight_micro_batches(inp, stage[0].pp_rank)
    if inp.transformer_engine:
        working, moment = _te_working(inp, stage)
        return StageActivations(per_mb, in_flight, working, moment)
    s, b = inp.seq_length / inp.cp, inp.micro_batch_size
    moments = _moments(inp, stage)
    moment = max(moments, key=lambda k: sum(moments[k].values()), default="")
    working = moments.get(moment, {})
    has_layers = any(c.num_layers for c in stage)
    buffers = core_attention.persistent(inp, s, b) if has_layers else {}
    return StageActivations(per_mb, in_flight, working, moment, buffers)
