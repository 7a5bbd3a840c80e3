"""Where a training step's time goes, by part of the model: the torch profiler over a few
`pretrain()` steps of the `bench_gpu.py` shape, each op's own device time (its CPU time without
CUDA) put under the part of the model that ran it.

    python tools/profile_step.py [--tiny] [--steps 3] [--warmup 2] [--attention auto|unfused]

Parts: GEMMs (every linear layer, the output layer apart), core attention, norms, the
activation of the MLP (SwiGLU: what the MLP runs between its two linear layers), the attention
block's own ops (rotary embedding and head reshapes: what it runs outside its linear layers and
core attention), the embedding, the loss (cross-entropy), residual adds and the other ops of a
layer, the optimizer step, and communication (NCCL/gloo collectives, wherever they run).
Backward ops count with the forward op they differentiate (the profiler's sequence numbers link
the two), so each part is its forward plus its backward (plus its recomputation, where selective
recompute repeats it). Gradient accumulation (autograd adding into the gradient buffers) and data
loading are parts of their own. Without CUDA the times are CPU times of the tiny shape: a check that the
breakdown covers the step, not a measurement of the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PREFIX = "part:"
BACKWARD = "autograd::engine::evaluate_function: "
COMMUNICATION = ("nccl", "c10d::", "gloo", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "broadcast")
PARTS = (
    "GEMMs", "GEMM output layer", "core attention", "norms", "activation (SwiGLU)", "rotary and head reshapes",
    "embedding", "loss (cross-entropy)", "residual adds and other layer ops", "optimizer", "communication",
    "gradient accumulation", "data loading", "outside the model",
)  # fmt: skip


def part_of(name: str, module) -> str | None:
    """The part a module's own ops belong to, by its class (None: its parent's part)."""
    kind = type(module).__name__
    if name.endswith("output_layer"):
        return "GEMM output layer"
    if "Linear" in kind:
        return "GEMMs"
    if "DotProductAttention" in kind or "SDPAttention" in kind:
        return "core attention"
    if "Norm" in kind:
        return "norms"
    if kind == "MLP":
        return "activation (SwiGLU)"
    if kind.endswith("SelfAttention"):
        return "rotary and head reshapes"
    if kind == "LanguageModelEmbedding":
        return "embedding"
    if kind == "TransformerLayer":
        return "residual adds and other layer ops"
    return None


def label_model(model) -> None:
    """Name the parts of `model` in the profile: each module's forward (and so its recomputation)
    inside a `part:<name>` range; the loss as its own part."""
    import torch

    def enter(part):
        def pre(_module, _inputs):
            _module._profile_ranges = getattr(_module, "_profile_ranges", [])
            scope = torch.autograd.profiler.record_function(PREFIX + part)
            scope.__enter__()
            _module._profile_ranges.append(scope)

        return pre

    def leave(_module, _inputs, _output):
        _module._profile_ranges.pop().__exit__(None, None, None)

    for name, module in model.named_modules():
        part = part_of(name, module)
        if part is not None:
            module.register_forward_pre_hook(enter(part))
            module.register_forward_hook(leave)
        if hasattr(type(module), "compute_language_model_loss"):
            module.compute_language_model_loss = labelled(module.compute_language_model_loss, "loss (cross-entropy)")


def labelled(fn, part: str):
    import torch

    def run(*args, **kwargs):
        with torch.autograd.profiler.record_function(PREFIX + part):
            return fn(*args, **kwargs)

    return run


def breakdown(events, cuda: bool) -> dict[str, float]:
    """Microseconds per part: each op's own device time (CPU time without CUDA), see `attribute`."""
    totals: dict[str, float] = defaultdict(float)
    for event, part in attribute(events):
        totals[part] += (getattr(event, "self_device_time_total", 0) or 0) if cuda else event.self_cpu_time_total
    return dict(totals)


def attribute(events):
    """(op, its part) for each op the profiler saw on the CPU (a CUDA kernel counts in the own
    device time of the op that launched it): the innermost `part:` range it ran in; for a
    backward op, the part of the forward op it differentiates (same thread and sequence number)."""
    from torch.autograd import DeviceType

    def enclosing(e):
        """(the innermost part range around `e`, whether `e` runs in it (no backward function
        between them: a forward, or a recomputation inside a backward), the backward functions
        around `e`, innermost first)."""
        part, own, backward = None, False, []
        while e is not None:
            if part is None and e.name.startswith(PREFIX):
                part, own = e.name[len(PREFIX) :], not backward
            elif part is None and "DataLoader" in e.name:
                part, own = "data loading", True
            if e.name.startswith(BACKWARD):
                backward.append(e)
            e = e.cpu_parent
        return part, own, backward

    ops = [e for e in events if e.device_type == DeviceType.CPU and not e.name.startswith(PREFIX)]
    places = [enclosing(e) for e in ops]
    forward_part: dict[tuple[int, int], str] = {}  # (thread, sequence number) of a forward op -> its part
    for e, (part, own, _) in zip(ops, places):
        if own and e.sequence_nr >= 0 and not e.name.startswith(BACKWARD):
            forward_part.setdefault((e.thread, e.sequence_nr), part)
    for e, (part, own, backward) in zip(ops, places):
        if any(word in e.name.lower() for word in COMMUNICATION):
            part = "communication"
        elif own:  # in a module's forward, also when recomputed during backward
            pass
        elif backward and "AccumulateGrad" in backward[0].name:  # into the gradient buffers
            part = "gradient accumulation"
        elif backward:  # autograd runs no forward hooks: a backward op's part is its forward op's
            found = (forward_part.get((b.fwd_thread, b.sequence_nr)) for b in backward)
            part = next((f for f in found if f is not None), part)
        yield e, part or "outside the model"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shape (the default without CUDA)")
    p.add_argument("--steps", type=int, default=3, help="steps profiled (at least 1)")
    p.add_argument("--warmup", type=int, default=2, help="steps run before profiling (0 or more)")
    p.add_argument("--attention", choices=("auto", "unfused"), default="auto",
                   help="auto: pretrain()'s choice (SDPA on local layers); unfused: DotProductAttention with "
                        "selective recompute")  # fmt: skip
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps {args.steps}: give at least 1 (the steps profiled)")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: give 0 or more")
    import torch
    from torch.profiler import ProfilerActivity, profile

    import bench_gpu
    from megatron_bridge.training.callbacks import Callback
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    cuda = torch.cuda.is_available()
    shape = bench_gpu.TINY_SHAPE if (args.tiny or not cuda) else bench_gpu.GPU_SHAPE
    te = bench_gpu.te_available() and cuda
    variant = "unfused" if args.attention == "unfused" else "pretrain"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profiler = profile(activities=activities)

    class Profiled(Callback):
        def __init__(self):
            self.steps = 0
            self.wall = 0.0

        def on_train_start(self, state):
            for chunk in state.model:
                label_model(chunk)
            state.optimizer.step = labelled(state.optimizer.step, "optimizer")

        def on_step_start(self, state):
            if self.steps == args.warmup:
                bench_gpu.synchronize()
                profiler.start()
                self.started = bench_gpu.time.perf_counter()

        def on_step_end(self, state, metrics):
            self.steps += 1
            if self.steps == args.warmup + args.steps:
                bench_gpu.synchronize()
                self.wall = bench_gpu.time.perf_counter() - self.started
                profiler.stop()

    profiled = Profiled()
    with tempfile.TemporaryDirectory() as workdir:
        cfg = bench_gpu.bench_config(shape, variant, args.warmup + args.steps, te, cuda, workdir)
        pretrain(cfg, forward_step, callbacks=[profiled])
    totals = breakdown(profiler.events(), cuda)
    total = sum(totals.values())
    unit = "device" if cuda else "CPU"
    print(f"device: {bench_gpu.torch_device_name() if cuda else 'CPU'}; layers: "
          f"{'TransformerEngine' if te else 'megatron-core local'}; attention: {args.attention}; shape: {shape}")  # fmt: skip
    print(f"{args.steps} steps profiled after {args.warmup}: {self_time(total, args.steps)} ms of {unit} time "
          f"per step, {args.steps and profiled.wall / args.steps * 1e3:.2f} ms wall per step")  # fmt: skip
    for part in sorted(totals, key=lambda k: -totals[k]):
        print(f"  {part:36s} {self_time(totals[part], args.steps):>10s} ms/step  {totals[part] / total:6.1%}")


def self_time(microseconds: float, steps: int) -> str:
    return f"{microseconds / 1e3 / max(steps, 1):.2f}"


if __name__ == "__main__":
    main()
