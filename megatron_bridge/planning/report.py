"""A plan as text (for `--dry-run` / `--plan-only`) and as JSON records (`--plan-only --json`)."""

from __future__ import annotations

from typing import Any, Optional

from megatron_bridge.planning import core_attention
from megatron_bridge.planning.buffers import optimizer_bytes_per_element
from megatron_bridge.planning.inputs import PlanInputs
from megatron_bridge.planning.memory import RankMemory
from megatron_bridge.planning.mtp import mtp_bytes

GIB = 2**30


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 120:
        return f"{seconds:.3g} s"
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def _precision(inp: PlanInputs) -> str:
    return inp.precision + (" (fp8 linear weights)" if inp.fp8_params else "")


def _stage_name(r: RankMemory, inp: PlanInputs) -> str:
    return f"stage {r.pp_rank}" if inp.pp > 1 else "every rank"


def layout_line(inp: PlanInputs) -> str:
    line = f"TP {inp.tp} x PP {inp.pp}"
    if inp.vp:
        line += f" (virtual {inp.vp})"
    line += f" x CP {inp.cp} x DP {inp.dp} = {inp.world_size} GPUs"
    if inp.is_moe:
        line += f"; experts: EP {inp.ep} x ETP {inp.etp}, expert-DP {inp.expert_dp}"
    return line


def _memory_rows(plan: Any) -> list[tuple[str, list[str], str]]:
    inp: PlanInputs = plan.inputs
    main_b, moment_b = optimizer_bytes_per_element(inp)
    shard = f"sharded over DP {inp.dp * inp.cp}" if inp.distributed_optimizer else "not sharded"
    opt_note = f"{main_b + moment_b} B per parameter ({'main params + ' if main_b else ''}"
    opt_note += ("Adam moments" if inp.optimizer == "adam" else "momentum") + f"), {shard}"
    if inp.cpu_offload_fraction:
        opt_note += f", {inp.cpu_offload_fraction:.0%} on the host"
    grad_name = "fp32" if inp.grad_reduce_in_fp32 or inp.param_bytes == 4 else "16-bit"
    recompute = inp.recompute_granularity or "none"
    if recompute == "selective":
        recompute += f" ({', '.join(inp.recompute_modules)})"
    act_note = f"MBS {inp.micro_batch_size}, seq {inp.seq_length}/CP {inp.cp}, recompute {recompute}, "
    act_note += f"SP {'on' if inp.sequence_parallel else 'off'}, {core_attention.describe(inp)}"
    ranks = plan.ranks
    rows = [
        (
            "parameters",
            [gib(r.state.params) for r in ranks],
            _precision(inp)
            + (", frozen base; adapters" if inp.peft else "")
            + (", in DP buffers" if inp.distributed_optimizer else ""),
        ),
        ("gradients", [gib(r.state.grads) for r in ranks], f"{grad_name} gradient buffers"),
        ("optimizer state", [gib(r.state.optimizer) for r in ranks], opt_note),
        ("activations", [gib(r.activations.total) for r in ranks], act_note),
        ("  per micro batch", [gib(r.activations.per_micro_batch) for r in ranks], "all layers of the rank"),
        (
            "  in flight",
            [f"{r.activations.in_flight:.3g}" for r in ranks],
            "micro batches held at the peak (1F1B warm-up)",
        ),
        ("  working set", [gib(r.activations.working_bytes) for r in ranks], _moments(ranks)),
    ]
    if any(r.activations.buffers for r in ranks):
        rows.append(("  buffers", [gib(r.activations.buffer_bytes) for r in ranks], _buffer_note(ranks)))
    rows += [
        (
            "workspace allowance",
            [gib(r.workspace) for r in ranks],
            "fixed: CUDA context, NCCL/cuBLAS workspaces, fragmentation",
        ),
        ("total", [gib(r.total) for r in ranks], f"of {gib(plan.gpu.memory_bytes)} GiB on {plan.gpu.name}"),
        ("margin", [gib(r.margin) for r in ranks], ""),
    ]
    return rows


def _moments(ranks: list[RankMemory]) -> str:
    moments = sorted({r.activations.moment for r in ranks if r.activations.moment})
    return "transient at the peak: " + "; ".join(moments) if moments else ""


def _buffer_note(ranks: list[RankMemory]) -> str:
    return "; ".join(sorted({k for r in ranks for k in r.activations.buffers}))


LAYERS = {"te": "TransformerEngine", "sdpa": "megatron-core local", "unfused": "megatron-core local"}
CORE = {"te": "TransformerEngine's", "sdpa": "PyTorch SDPA", "unfused": "megatron-core's unfused"}
LOCAL_AUTO = "(attention_backend auto: SDPA where it serves the config)"


def layers_lines(inp: PlanInputs) -> list[str]:
    """Which layers and core attention the plan is for, why, and the settings that choose them."""
    line = f"layers: {LAYERS[inp.core_attention]}, {CORE[inp.core_attention]} core attention ({inp.layers_note})"
    if inp.core_attention == "te" and inp.local_core_attention != "te":  # TE only because of CP
        choose = f"model.context_parallel_size=1 plans megatron-core's local layers {LOCAL_AUTO}"
    elif inp.core_attention == "te":
        choose = f"model.transformer_impl=local plans megatron-core's local layers {LOCAL_AUTO}"
    else:
        other = (
            "unfused plans megatron-core's DotProductAttention"
            if inp.core_attention == "sdpa"
            else "auto plans SDPA where it serves the config"
        )
        choose = (
            "model.transformer_impl=transformer_engine plans TransformerEngine layers (TE must be installed to run "
            f"them); model.attention_backend={other}"
        )
        if not inp.input_norms:  # TE fuses the norms before attention and MLP into its linear layers
            choose = f"model.attention_backend={other} (no TransformerEngine layers: the model has no input norms)"
    return [line, f"  to choose: {choose}"]


def peft_line(plan: Any) -> Optional[str]:
    """LoRA/DoRA: what trains and what is frozen."""
    inp: PlanInputs = plan.inputs
    if inp.peft is None:
        return None
    kinds = sorted({rel.rsplit(".", 1)[-1] for layer in inp.peft_modules for rel in layer})
    adapted = sum(len(layer) for layer in inp.peft_modules)
    r = plan.worst.state
    total = r.trainable_elements + r.frozen_elements
    share = f" ({r.trainable_elements / total:.2%} of the rank's parameters)" if total else ""
    return (
        f"peft: {'LoRA' if inp.peft == 'lora' else 'DoRA'} rank {inp.peft_dim} on {adapted} linear layers "
        f"({', '.join(kinds)}); {count(r.trainable_elements)} trainable parameters on the fullest rank{share}, "
        "the frozen base in its 16-bit parameters without gradients or optimizer state"
    )


def mtp_line(inp: PlanInputs) -> Optional[str]:
    """Multi-token prediction: where its depths are and what they keep."""
    if not inp.mtp_depths:
        return None
    kind = "mixture-of-experts" if inp.moe_layer_pattern[-1] else "dense"
    where = f"stage {inp.pp - 1}, with a copy of the word embedding" if inp.pp > 1 else "every rank"
    return (
        f"multi-token prediction: {inp.mtp_depths} depth{'s' if inp.mtp_depths > 1 else ''} on {where}, each a "
        f"2h -> h projection and a {kind} layer like the last decoder layer; with their losses they keep "
        f"{gib(mtp_bytes(inp))} GiB per micro batch for backward"
    )


def plan_text(plan: Any) -> list[str]:
    """The plan as lines of text."""
    inp: PlanInputs = plan.inputs
    t = plan.timing
    lines = [f"plan{': ' + plan.label if plan.label else ''} on {inp.world_size} x {plan.gpu.name}"]
    lines.append(f"layout: {layout_line(inp)}")
    lines += layers_lines(inp)
    peft = peft_line(plan)
    if peft:
        lines.append(peft)
    mtp = mtp_line(inp)
    if mtp:
        lines.append(mtp)
    lines.append(
        f"batch: global {inp.global_batch_size} = micro {inp.micro_batch_size} x {inp.num_microbatches} micro batches"
        f" x DP {inp.dp}; "
        f"pipeline bubble {t.bubble:.1%}"
    )
    lines.append("memory per GPU (GiB):")
    ranks = plan.ranks
    names = [_stage_name(r, inp) for r in ranks]
    rows = _memory_rows(plan)
    label_w = max(len(r[0]) for r in rows) + 2
    col_w = max(8, *(len(n) for n in names))
    lines.append("  " + " " * label_w + "".join(f"{n:>{col_w + 1}}" for n in names))
    for label, values, note in rows:
        lines.append(
            "  " + f"{label:<{label_w}}" + "".join(f"{v:>{col_w + 1}}" for v in values) + (f"   {note}" if note else "")
        )
    worst = plan.worst
    if plan.fits:
        lines.append(f"fits: yes, {gib(worst.margin)} GiB left on the fullest GPU ({_stage_name(worst, inp)})")
    else:
        over = [r for r in ranks if not r.fits]
        lines.append(
            f"fits: NO, {gib(-worst.margin)} GiB over on {_stage_name(worst, inp)}"
            + (f" ({len(over)} of {len(ranks)} stages over)" if inp.pp > 1 else "")
            + f"; largest parts: {_largest_parts(worst)}"
        )
    lines.append(f"time at MFU {plan.mfu:.2f} (assumed; --mfu) of {plan.gpu.peak_flops / 1e12:.0f} TFLOP/s bf16 peak:")
    lines.append(
        f"  {t.flops_per_token:.3g} FLOPs/token, {t.flops_per_step:.3g} FLOPs/step, "
        f"{count(t.tokens_per_step)} tokens/step"
    )
    lines.append(
        f"  step {t.step_time_s:.3g} s, {count(t.tokens_per_s)} tokens/s "
        f"({count(t.tokens_per_s / inp.world_size)} per GPU)"
    )
    if t.train_iters is not None:
        lines.append(f"  {t.train_iters} iterations: {duration(t.time_to_train_s)}, {count(t.total_tokens)} tokens")
    if not plan.fits:
        lines.append(
            "fixes (ranked by estimated tokens/s, each re-planned):"
            if plan.fixes
            else "fixes: none found within TP <= 8 and up to 16x the GPUs"
        )
        for i, fix in enumerate(plan.fixes, 1):
            ev = fix.evaluation
            lines.append(f"  {i}. {fix.description}")
            lines.append(
                f"     -> {gib(ev.worst.total)} GiB on the fullest GPU ({gib(ev.worst.margin)} left), "
                f"step {ev.timing.step_time_s:.3g} s, {count(ev.timing.tokens_per_s)} tokens/s"
            )
            lines.append(f"     {' '.join(fix.overrides)}")
    return lines


def _largest_parts(r: RankMemory) -> str:
    parts = {
        "parameters": r.state.params,
        "gradients": r.state.grads,
        "optimizer": r.state.optimizer,
        "activations": r.activations.total,
    }
    top = sorted(parts.items(), key=lambda kv: kv[1], reverse=True)[:2]
    return ", ".join(f"{k} {gib(v)} GiB" for k, v in top)


def json_records(plan: Any) -> list[dict[str, Any]]:
    """One dict per rank layout: bytes per GPU, fit, and the plan's time figures."""
    inp: PlanInputs = plan.inputs
    t = plan.timing
    records = []
    for r in plan.ranks:
        records.append(
            {
                "layout": _stage_name(r, inp),
                "pp_rank": r.pp_rank,
                "layers": r.layers,
                "tp": inp.tp,
                "pp": inp.pp,
                "vp": inp.vp,
                "cp": inp.cp,
                "dp": inp.dp,
                "ep": inp.ep,
                "etp": inp.etp,
                "expert_dp": inp.expert_dp if inp.is_moe else None,
                "world_size": inp.world_size,
                "params_bytes": r.state.params,
                "grads_bytes": r.state.grads,
                "optimizer_bytes": r.state.optimizer,
                "optimizer_host_bytes": r.state.optimizer_host,
                "activations_bytes": int(r.activations.total),
                "activations_per_micro_batch_bytes": int(r.activations.per_micro_batch),
                "activations_working_set_bytes": int(r.activations.working_bytes),
                "activations_peak_moment": r.activations.moment,
                "activations_buffer_bytes": int(r.activations.buffer_bytes),
                "layer_impl": "transformer_engine" if inp.transformer_engine else "local",
                "core_attention": inp.core_attention,
                "peft": inp.peft,
                "mtp_depths": inp.mtp_depths,
                "trainable_parameters": r.state.trainable_elements,
                "frozen_parameters": r.state.frozen_elements,
                "micro_batches_in_flight": r.activations.in_flight,
                "workspace_bytes": r.workspace,
                "total_bytes": int(r.total),
                "gpu": plan.gpu.key,
                "gpu_bytes": plan.gpu.memory_bytes,
                "margin_bytes": int(r.margin),
                "fits": r.fits,
                "mfu": plan.mfu,
                "flops_per_step": t.flops_per_step,
                "step_time_s": t.step_time_s,
                "tokens_per_s": t.tokens_per_s,
                "pipeline_bubble": t.bubble,
                "time_to_train_s": t.time_to_train_s,
                "total_tokens": t.total_tokens,
                "fixes": [
                    {
                        "description": f.description,
                        "overrides": f.overrides,
                        "world_size": f.world_size,
                        "total_bytes": int(f.evaluation.worst.total),
                        "step_time_s": f.evaluation.timing.step_time_s,
                    }
                    for f in plan.fixes
                ],
            }
        )
    return records
