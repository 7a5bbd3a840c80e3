"""Time: FLOPs per step, step time and tokens/s at a stated MFU, the pipeline bubble.

Model FLOPs come from `megatron_bridge.models.param_count.flops_per_token` (6 x active matmul
parameters + attention). The stated MFU is taken as what the configured run achieves. A change
of layout (a fix) is timed relative to it: recompute adds its extra forward work, and a larger
or smaller pipeline bubble scales the step. Communication is not modeled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_bridge.planning.inputs import PlanInputs

DEFAULT_MFU = 0.40
"""Model FLOPs utilization assumed unless `--mfu` says otherwise."""


def bubble_fraction(inp: PlanInputs) -> float:
    """Share of a step the pipeline stands idle: (p - 1) / (v m + p - 1)."""
    if inp.pp == 1:
        return 0.0
    v = inp.vp or 1
    return (inp.pp - 1) / (v * inp.num_microbatches + inp.pp - 1)


def attention_flops_per_token(inp: PlanInputs) -> float:
    """Forward + backward FLOPs of the attention score and context matmuls, per token."""
    if inp.mla:  # QK^T over the rope and no-rope parts, AV over the value heads
        widths = inp.qk_head_dim + inp.qk_rope_dim + inp.v_head_dim
        return 3.0 * 2 * (inp.num_layers + inp.mtp_depths) * inp.seq_length * inp.heads * widths
    return 3.0 * 2 * 2 * (inp.num_layers + inp.mtp_depths) * inp.seq_length * inp.heads * inp.kv_channels


def hardware_factor(inp: PlanInputs, model_flops_per_token: float) -> float:
    """Work the GPUs do over the model FLOPs: recompute runs part of the forward again."""
    output_layer = 6.0 * (1 + inp.mtp_depths) * inp.padded_vocab * inp.hidden
    if inp.recompute_granularity == "full":
        return 1.0 + (model_flops_per_token - output_layer) / 3 / model_flops_per_token
    if inp.recompute_granularity == "selective" and "core_attn" in inp.recompute_modules:
        return 1.0 + attention_flops_per_token(inp) / 3 / model_flops_per_token
    return 1.0


@dataclass
class Timing:
    """Step time and throughput of a plan."""

    flops_per_token: float
    flops_per_step: float
    tokens_per_step: int
    mfu: float
    peak_flops: float
    world_size: int
    step_time_s: float
    bubble: float
    train_iters: Optional[int]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def time_to_train_s(self) -> Optional[float]:
        return None if self.train_iters is None else self.step_time_s * self.train_iters

    @property
    def total_tokens(self) -> Optional[int]:
        return None if self.train_iters is None else self.tokens_per_step * self.train_iters


def timing(
    inp: PlanInputs,
    base_flops_per_token: float,
    base_padded_vocab: int,
    peak_flops: float,
    mfu: float,
    reference: Optional[PlanInputs] = None,
) -> Timing:
    """Timing of `inp`. `base_flops_per_token` is `flops_per_token` of the config at
    `base_padded_vocab`; `reference` (the configured inputs) anchors the stated MFU when `inp` is
    a changed layout."""
    output_layers = 1 + inp.mtp_depths  # run per token: the model's and each prediction depth's
    fpt = base_flops_per_token + 6.0 * output_layers * inp.hidden * (inp.padded_vocab - base_padded_vocab)
    tokens = inp.global_batch_size * inp.seq_length
    flops = fpt * tokens
    seconds = flops / (inp.world_size * peak_flops * mfu)
    if reference is not None:
        ref_vocab = reference.padded_vocab - base_padded_vocab
        ref_fpt = base_flops_per_token + 6.0 * output_layers * reference.hidden * ref_vocab
        seconds *= hardware_factor(inp, fpt) / hardware_factor(reference, ref_fpt)
        seconds *= (1 - bubble_fraction(reference)) / (1 - bubble_fraction(inp))
    return Timing(fpt, flops, tokens, mfu, peak_flops, inp.world_size, seconds, bubble_fraction(inp), inp.train_iters)
