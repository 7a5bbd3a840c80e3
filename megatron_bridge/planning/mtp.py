"""Multi-token prediction's activations: what megatron-core's prediction depths keep for backward
on the last pipeline stage, and the moment of a step their backward adds.

Each depth (`MultiTokenPredictionLayer`) looks the next tokens up in the shared embedding,
normalizes that embedding and the hidden state, projects both (2h -> h) into a transformer layer
built like the last decoder layer, and normalizes its output; `GPTModel` then concatenates the
hidden states of the model and of every depth and computes each depth's logits and loss in the
forward pass, so their fp32 softmax stays until the backward pass. `tests/test_planner_activations.py`
compares a depth with the tensors autograd saves and the peak of whole steps with the plan.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from megatron_bridge.planning import core_attention
from megatron_bridge.planning import layer_activations as activations
from megatron_bridge.planning.inputs import PlanInputs

MTP_LOSS = (
    "MTP softmax of the logits (fp32, cross entropy)", "MTP loss targets, mask and scaled loss (per token)",
)  # fmt: skip
"""Terms of a multi-token prediction depth that its loss keeps (freed first in backward)."""
MTP_OUTPUT_INPUTS = (
    "MTP output layer input (its slice of the concatenated hidden states)",
    "main output layer input (its slice of the concatenated hidden states)",
)
"""The hidden states of the model and of every depth, concatenated: the output layers' inputs are
slices of one storage, freed when the last of them has run its backward."""
MTP_OUTPUT = (*MTP_OUTPUT_INPUTS, "MTP final norm input", "MTP final norm statistics (fp32 per token)")


def _mtp_recomputed(inp: PlanInputs) -> bool:
    """megatron-core checkpoints a depth's projection and layer with full uniform recompute (block
    recompute skips them)."""
    return inp.recompute_granularity == "full" and inp.recompute_method == "uniform"


@lru_cache(maxsize=256)
def mtp_depth_terms(inp: PlanInputs, depth: int, recomputed: Optional[bool] = None) -> dict[str, float]:
    """Bytes multi-token prediction depth `depth` keeps for backward, per micro batch, on the last
    stage, by tensor: the token ids of its embedding lookup, the embedding, the norms' statistics,
    the projection's input, its transformer layer's tensors (`layer_terms` of the last decoder
    layer's kind, with its own mask), the final norm's input, its slice of the concatenated hidden
    states (the output layer's input), the input of its hidden-state norm (for the first depth the
    decoder's output, planned with the decoder; here the main output layer's slice instead), and
    its loss's softmax, targets, loss mask and scaled loss. Recomputed (`recomputed`, by default the
    config's), the checkpoint keeps the embedding only of what precedes the final norm's output."""
    s = inp.seq_length / inp.cp
    b, h, e = inp.micro_batch_size, inp.hidden, inp.activation_bytes
    sp = inp.tp if inp.sequence_parallel else 1
    sbh = s * b * h
    if recomputed is None:
        recomputed = _mtp_recomputed(inp)
    terms: dict[str, float] = {}

    def add(name: str, value: float) -> None:
        if value:
            terms[name] = terms.get(name, 0.0) + value

    ids = 2 if inp.learned_positions else 1  # token and position ids
    add("MTP next-token ids (int64, the embedding lookup's)", ids * 8 * s * b)
    if inp.hidden_dropout > 0:
        add("MTP embedding dropout mask", sbh / sp)
    add("MTP next-token embedding (embedding norm input)", e * sbh / sp)
    if not recomputed:
        if not inp.transformer_engine:
            stats = 2 * activations.norm_stats(inp) * s * b / sp
            add("MTP embedding and hidden-state norm statistics (fp32 per token)", stats)
        add("MTP projection input (both norm outputs, 2h)", 2 * e * sbh / sp)
        for name, value in activations.layer_terms(inp, inp.moe_layer_pattern[-1], None, inp.mtp_masks[depth]).items():
            add(f"MTP layer: {name}", value)
        add("MTP final norm input", e * sbh / sp)
        if not inp.transformer_engine:
            add("MTP final norm statistics (fp32 per token)", activations.norm_stats(inp) * s * b / sp)
    # megatron-core concatenates the hidden states of the model and of each depth, and each output
    # layer keeps its slice; each depth's hidden-state norm keeps its input, the preceding final
    # norm's output (the first depth's is the decoder's, planned with the decoder)
    add(MTP_OUTPUT_INPUTS[0], e * sbh / sp)
    if depth == 0:
        add(MTP_OUTPUT_INPUTS[1], e * sbh / sp)
    else:
        add("MTP hidden-state norm input (the preceding depth's final norm output)", e * sbh / sp)
    add("MTP softmax of the logits (fp32, cross entropy)", 4 * s * b * inp.padded_vocab / inp.tp)
    # target mask (bool), vocabulary-local targets (int64), the rolled loss mask (fp32), the scaled loss (fp32)
    add("MTP loss targets, mask and scaled loss (per token)", (1 + 8 + 4 + 4) * s * b)
    return terms


def mtp_bytes(inp: PlanInputs) -> float:
    """What all multi-token prediction depths keep for backward, per micro batch."""
    return sum(sum(mtp_depth_terms(inp, d).values()) for d in range(inp.mtp_depths))


def last_depth_moment(inp: PlanInputs, s: float, b: int, tied_grad: float) -> dict[str, float]:
    """The core attention backward of the last depth's layer: every depth's loss and output layer
    has run its backward (they were computed last), so has the last depth's norm and its layer's
    MLP block; the other depths' tensors are still kept, and so is a tied output-layer weight
    gradient (`tied_grad`; the depths look their tokens up in the same weight)."""
    last = inp.mtp_depths - 1
    core = core_attention.working_set(inp, s, b, inp.mtp_masks[last])
    kept = mtp_depth_terms(inp, last)
    moment: dict[str, float] = {}
    if _mtp_recomputed(inp):
        full = mtp_depth_terms(inp, last, recomputed=False)
        moment["last MTP depth recomputed for its backward"] = sum(full.values()) - sum(kept.values())
        kept = full
    moment.update(core)
    if tied_grad:
        moment["output-layer weight gradient (tied; held until the embedding's backward)"] = tied_grad
    # the output layers' input gradients, joined as one for the concatenated hidden states; the
    # decoder's slice waits there for the first depth's gradient
    sp = inp.tp if inp.sequence_parallel else 1
    width = (1 + inp.mtp_depths) * s * b * inp.hidden / sp
    moment["gradient of the concatenated hidden states"] = inp.activation_bytes * width
    done = MTP_LOSS + MTP_OUTPUT_INPUTS
    losses = sum(sum(v for k, v in mtp_depth_terms(inp, d).items() if k in done) for d in range(last))
    moment["losses and output-layer inputs of the other depths (freed by then)"] = -losses
    mlp_block = {f"MTP layer: {name}" for name in activations.MLP_BLOCK}
    freed = sum(v for k, v in kept.items() if k in MTP_LOSS + MTP_OUTPUT or k in mlp_block)
    moment["last depth's loss, output, final norm and layer's MLP block (freed by then)"] = -freed
    return moment
