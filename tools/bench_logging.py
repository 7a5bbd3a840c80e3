"""Cost of experiment tracking: the tiny model at log_interval=1 with all four trackers vs none.

    python tools/bench_logging.py [--iters 2400] [--block 10] [--control] [--rounds 0] [--in-process]
    OMP_NUM_THREADS=1 python tools/bench_logging.py   # training leaves a core to the trackers

The main measurement is one training run with TensorBoard, W&B (offline), MLflow (sqlite) and
Comet (offline), all writing into a temp dir, whose iterations alternate in blocks of `--block`:
- "on" blocks log every step to the trackers, and their process (with its children) runs;
- "off" blocks send nothing and the tracker processes are stopped (SIGSTOP), so that no
  tracking work of any kind happens: the run is then, for the train loop, one without trackers.
Console logging runs in both. Each on block's mean iteration time (log step and the trackers'
background work included) is divided by the mean of its two neighbouring off blocks; the overhead
is the median of these ratios (target: under 1%), with the mean and two standard errors.

Why not separate runs with and without trackers: this machine's cores change speed by up to
1.7x for seconds at a time (the same loop of Python takes 170-300 ms), so two runs seconds apart
differ by more than 10% on their own. Neighbouring blocks of one run see the same speed.
`--control` runs the same schedule with the trackers silent and stopped in every block: its
"overhead" shows the method's own error. `--rounds N` adds the separate-runs comparison
(fresh processes, shuffled order), `--in-process` a third run per round with the trackers in the
training process (logger.tracker_subprocess=False).

It also prints the time the training thread spends handing log steps to the tracker process,
the CPU time that process uses, and what each backend costs per log step on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_bridge.training.callbacks import Callback

SEQ, VOCAB, MBS, GBS, LAYERS, HIDDEN, HEADS = 32, 256, 4, 8, 2, 64, 4
WARMUP_PAIRS = 2  # on/off pairs left out at the start (allocator, caches, the trackers' first writes)
WARMUP_ITERS = 20  # iterations left out of each separate run


def tiny_config(iters: int, trackers: dict):
    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.training.config import (
        ConfigContainer,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    model = GPTModelProvider(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        seq_length=SEQ,
        vocab_size=VOCAB,
        position_embedding_type="rope",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        transformer_impl="local",
    )
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=iters, global_batch_size=GBS, micro_batch_size=MBS),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4),
        dataset=MockGPTDatasetConfig(seq_length=SEQ, num_workers=0, split="1,0,0"),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        validation=ValidationConfig(eval_iters=0),
        logger=LoggerConfig(log_interval=1, **trackers),
    )


def tracker_fields(workdir: str) -> dict:
    """The logger fields of all four trackers, writing under `workdir`."""
    return dict(
        tensorboard_dir=f"{workdir}/tb",
        wandb_project="bench",
        wandb_exp_name="bench",
        wandb_save_dir=f"{workdir}/wandb",
        mlflow_experiment="bench",
        mlflow_run_name="bench",
        mlflow_tracking_uri=f"sqlite:///{workdir}/mlflow.db",
        comet_project="bench",
        comet_experiment_name="bench",
        comet_offline_directory=f"{workdir}/comet",
    )


def tracker_tree(tracker) -> list:
    """The tracker process and its children (W&B's service), as psutil processes."""
    import psutil

    proc = getattr(tracker, "proc", None)
    if proc is None:
        return []
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(processes: list) -> float:
    """User+system CPU seconds of `processes` so far."""
    import psutil

    total = 0.0
    for p in processes:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def _signal_all(processes: list, signum: int) -> None:
    for p in processes:
        try:
            os.kill(p.pid, signum)
        except ProcessLookupError:
            pass


class Timing(Callback):
    """Times from one step start to the next (the log step runs after `on_step_end`, so it is
    included), the time the training thread spends in the tracker's `log_metrics`, and the
    tracker processes' CPU time. With `block`, alternates on/off blocks as the module says;
    with `control`, every block is off."""

    def __init__(self, block: int = 0, control: bool = False):
        self.block, self.control = block, control
        self.starts: list[float] = []
        self.on = True
        self.handoff = 0.0
        self.cpu: list[float] = []  # tracker CPU seconds at each block start (and at the end)
        self.processes: list = []
        self.cpu_start = 0.0

    def on_train_start(self, state):
        tracker, timing = state.tracker, self
        inner = tracker.log_metrics

        def log_metrics(metrics, step):
            if timing.on:
                t = time.perf_counter()
                inner(metrics, step)
                timing.handoff += time.perf_counter() - t

        tracker.log_metrics = log_metrics
        self.threads = torch_threads()
        self.processes = tracker_tree(tracker)
        self.cpu_start = cpu_seconds(self.processes)

    def on_step_start(self, state):
        index = len(self.starts)
        self.starts.append(time.perf_counter())
        if self.block and index % self.block == 0:
            self.cpu.append(cpu_seconds(self.processes))
            on = (index // self.block) % 2 == 0 and not self.control
            if on != self.on:
                _signal_all(self.processes, signal.SIGCONT if on else signal.SIGSTOP)
                self.on = on

    def on_train_end(self, state):
        self.starts.append(time.perf_counter())
        self.cpu.append(cpu_seconds(self.processes))
        _signal_all(self.processes, signal.SIGCONT)  # it must finish and close

    @property
    def times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


def train_once(variant: str, iters: int, workdir: str, block: int = 0) -> dict:
    """One run in this process. `variant`: none, all (trackers in their process), in-process,
    interleaved (all, alternating on/off blocks), control (interleaved, every block off)."""
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    trackers = {}
    if variant != "none":
        trackers = dict(tracker_subprocess=variant != "in-process", **tracker_fields(workdir))
    timing = Timing(block if variant in ("interleaved", "control") else 0, control=variant == "control")
    try:
        pretrain(tiny_config(iters, trackers), forward_step, callbacks=[timing])
    finally:
        _signal_all(timing.processes, signal.SIGCONT)
    # the tracker processes are this process's only children, and have exited and been waited for
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "iteration_times": timing.times,
        "handoff": timing.handoff,
        "cpu": timing.cpu,
        "threads": timing.threads,
        "tracker_cpu_after_start": children.ru_utime + children.ru_stime - timing.cpu_start,
    }


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def backend_costs(workdir: str, steps: int = 300, per_batch: int = 30) -> dict:
    """CPU seconds per log step of each backend on its own, in this process: the work the
    tracker process does for every log step (batches of `per_batch` steps, as it receives them)."""
    from types import SimpleNamespace

    from megatron_bridge.training.config import CheckpointConfig, LoggerConfig
    from megatron_bridge.training.loggers.base import Record
    from megatron_bridge.training.loggers.factory import instantiate, tracker_specs

    cfg = SimpleNamespace(logger=LoggerConfig(**tracker_fields(workdir)), checkpoint=CheckpointConfig())
    metrics = {name: 1.0 for name in LOG_STEP_METRICS}
    costs = {}
    for spec in tracker_specs(cfg):
        tracker = instantiate(spec)
        start = time.process_time()
        for first in range(0, steps, per_batch):
            tracker.log_many([Record(step, dict(metrics), time.time()) for step in range(first, first + per_batch)])
        costs[spec.name] = (time.process_time() - start) / steps
        tracker.close(failed=False)
    return costs


# what a log step of the benchmark's run sends (log_interval=1, default metric groups)
LOG_STEP_METRICS = (
    "lm loss", "learning-rate", "iteration-time", "tokens-per-second", "batch-size", "consumed-samples",
    "skipped-iterations", "nan-iterations", "grad-norm", "loss-scale",
)  # fmt: skip


def run_child(variant: str, args: argparse.Namespace) -> dict:
    """`variant` in a fresh process (and a temp dir for the trackers' files)."""
    with tempfile.TemporaryDirectory() as workdir:
        env = dict(
            os.environ,
            MLFLOW_DISABLE_TELEMETRY="true",
            COMET_ERROR_TRACKING_ENABLE="false",
            WANDB_MODE="offline",
            WANDB_DIR=workdir,
            WANDB_CACHE_DIR=f"{workdir}/wandb-cache",
            WANDB_CONFIG_DIR=f"{workdir}/wandb-config",
            WANDB_SILENT="true",
        )
        command = [sys.executable, __file__, "--child", variant, "--workdir", workdir]
        command += ["--iters", str(args.iters), "--block", str(args.block), "--run-iters", str(args.run_iters)]
        out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    line = next(line for line in out.stdout.splitlines() if line.startswith("BENCH "))
    return json.loads(line[len("BENCH ") :])


def block_ratios(times: list[float], block: int) -> tuple[list[float], list[tuple[bool, float]]]:
    """Each on block's mean iteration time over the mean of its two off neighbours, after the
    warm-up pairs; also (on, mean) of every block used."""
    blocks = [times[i : i + block] for i in range(0, len(times) - block + 1, block)]
    means = [(k % 2 == 0, statistics.mean(b)) for k, b in enumerate(blocks)][2 * WARMUP_PAIRS :]
    # after the warm-up pairs, the first block used is on; its left neighbour is the last warm-up block
    left = statistics.mean(blocks[2 * WARMUP_PAIRS - 1]) if WARMUP_PAIRS else None
    ratios = []
    for k in range(0, len(means) - 1, 2):
        before = means[k - 1][1] if k else left
        if before is None:
            continue
        ratios.append(means[k][1] / ((before + means[k + 1][1]) / 2))
    return ratios, means


def report_interleaved(label: str, got: dict, block: int) -> float:
    times = got["iteration_times"]
    ratios, means = block_ratios(times, block)
    mean_ratio = statistics.mean(ratios)
    two_se = 2 * statistics.stdev(ratios) / len(ratios) ** 0.5
    on = [m for is_on, m in means if is_on]
    off = [m for is_on, m in means if not is_on]
    print(f"{label}: {len(ratios)} on/off block pairs of {block} iterations, training on {got['threads']} of "
          f"{os.cpu_count()} cores; mean iteration {statistics.mean(on) * 1000:.2f} ms "
          f"on, {statistics.mean(off) * 1000:.2f} ms off")  # fmt: skip
    q = statistics.quantiles(ratios, n=4)
    print(f"  overhead: {100 * (statistics.median(ratios) - 1):+.2f}% (median of block ratios; mean "
          f"{100 * (mean_ratio - 1):+.2f}% +- {100 * two_se:.2f}; quartiles {q[0]:.3f} {q[2]:.3f})")  # fmt: skip
    return statistics.median(ratios) - 1


def report_costs(got: dict, block: int, base: float) -> None:
    times, cpu = got["iteration_times"], got["cpu"]
    on_iters = sum(len(times[i : i + block]) for i in range(0, len(times), 2 * block))
    on_cpu = sum(cpu[k + 1] - cpu[k] for k in range(0, len(cpu) - 1, 2))
    off_cpu = sum(cpu[k + 1] - cpu[k] for k in range(1, len(cpu) - 1, 2))
    per_iter = got["handoff"] / on_iters
    print(f"training thread, handing log steps to the tracker process: {per_iter * 1e6:.0f} us/iteration "
          f"= {100 * per_iter / base:.2f}% of an off-block iteration")  # fmt: skip
    total = got["tracker_cpu_after_start"]
    print(f"tracker processes' CPU (SCHED_IDLE) from the first step to the end of closing: {total / on_iters * 1000:.2f} "
          f"ms per log step, of which "
          f"{on_cpu / on_iters * 1000:.2f} ms during training (the rest while the run closed); "
          f"{off_cpu * 1000:.0f} ms in all off blocks (stopped)")  # fmt: skip


def separate_runs(args: argparse.Namespace) -> None:
    variants = ["none", "all"] + (["in-process"] if args.in_process else [])
    per_round: dict[str, list[float]] = {v: [] for v in variants}
    for round_index in range(args.rounds):
        order = list(variants)
        random.Random(round_index).shuffle(order)  # no variant always runs first (machine-state drift)
        for variant in order:
            steady = run_child(variant, args)["iteration_times"][WARMUP_ITERS:]
            per_round[variant].append(statistics.mean(steady))
    labels = {"all": "4 trackers", "in-process": "4 trackers in the training process"}
    print(f"separate runs ({args.rounds} rounds x {args.run_iters} iterations, fresh processes, mean per run): "
          f"no trackers {' '.join(f'{x * 1000:.1f}' for x in per_round['none'])} ms")  # fmt: skip
    for variant in variants[1:]:
        ratios = [a / n for a, n in zip(per_round[variant], per_round["none"], strict=True)]
        print(f"  {labels[variant]}: round ratios {' '.join(f'{r:.3f}' for r in ratios)}, "
              f"median {100 * (statistics.median(ratios) - 1):+.2f}%")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=2400, help="iterations of the interleaved run")
    p.add_argument("--block", type=int, default=10, help="iterations per on or off block")
    p.add_argument("--control", action="store_true", help="also the same schedule with every block off")
    p.add_argument("--rounds", type=int, default=0, help="rounds of separate runs with and without trackers")
    p.add_argument("--run-iters", type=int, default=200, help="iterations of each separate run")
    p.add_argument("--in-process", action="store_true", help="separate runs: also the trackers in the training process")
    p.add_argument("--child", choices=("none", "all", "in-process", "interleaved", "control", "backends"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "backends":
        print("BENCH " + json.dumps(backend_costs(args.workdir)), flush=True)
        return
    if args.child:
        iters = args.iters if args.child in ("interleaved", "control") else args.run_iters
        print("BENCH " + json.dumps(train_once(args.child, iters, args.workdir, args.block)), flush=True)
        return

    got = run_child("interleaved", args)
    report_interleaved("4 trackers, interleaved in one run", got, args.block)
    _, means = block_ratios(got["iteration_times"], args.block)
    base = statistics.mean(m for is_on, m in means if not is_on)
    report_costs(got, args.block, base)
    if args.control:
        report_interleaved("control: same schedule, trackers silent and stopped in every block", run_child("control", args), args.block)
    if args.rounds:
        separate_runs(args)
    costs = run_child("backends", args)
    print("backend CPU per log step, each alone: " + ", ".join(f"{name} {sec * 1000:.2f} ms" for name, sec in costs.items())
          + f" (sum {sum(costs.values()) * 1000:.2f} ms = {100 * sum(costs.values()) / base:.1f}% of an off-block iteration)")  # fmt: skip
    print("target: under 1% at log_interval=1")


if __name__ == "__main__":
    main()
