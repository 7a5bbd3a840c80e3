"""Cost of experiment tracking: the tiny model at log_interval=1 with all four trackers vs none.

    python tools/bench_logging.py [--rounds 5] [--iters 200] [--in-process]

Each round runs, in shuffled order and in fresh processes, the tiny model without trackers and
with TensorBoard, W&B (offline), MLflow (sqlite) and Comet (offline), all writing into a temp dir
(with --in-process also a third run with those trackers in the training process). It prints per
variant the median time from one step start to the next (the log step included; the first 20
iterations excluded: warm-up and the trackers' start) and the mean, then the overhead of tracking
(target: under 1%) as the median over rounds of the ratio of a round's runs, which cancels most
of the drift in machine load. It also reports the time the training thread spends handing each
log step to the tracker process, the CPU time that process uses (at idle priority) while
training, and what each backend costs per log step on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

WARMUP = 20
SEQ, VOCAB, MBS, GBS, LAYERS, HIDDEN, HEADS = 32, 256, 4, 8, 2, 64, 4


def train_once(variant: str, iters: int, workdir: str) -> dict:
    """One run in this process; returns per-iteration seconds."""
    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.training.callbacks import Callback
    from megatron_bridge.training.config import (
        ConfigContainer,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    class Timing(Callback):
        """Per-iteration times from one step start to the next (so including the log step, which
        runs after `on_step_end`); also the time the training thread spends in the tracker's
        `log_metrics` and the CPU time of the tracker process (and its children) while training."""

        def __init__(self):
            self.starts, self.handoff, self.tracker_cpu, self.cpu_start = [], 0.0, 0.0, 0.0

        def on_train_start(self, state):
            tracker, timing = state.tracker, self
            inner = tracker.log_metrics

            def timed(metrics, step):
                t = time.perf_counter()
                inner(metrics, step)
                timing.handoff += time.perf_counter() - t

            tracker.log_metrics = timed
            self.cpu_start = tracker_cpu_seconds(tracker)

        def on_step_start(self, state):
            self.starts.append(time.perf_counter())

        def on_train_end(self, state):
            self.starts.append(time.perf_counter())
            self.tracker_cpu = tracker_cpu_seconds(state.tracker) - self.cpu_start

        @property
        def times(self) -> list[float]:
            return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]

    trackers = {}
    if variant in ("all", "in-process"):
        trackers = dict(tracker_subprocess=variant == "all", **tracker_fields(workdir))
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
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=iters, global_batch_size=GBS, micro_batch_size=MBS),
        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4),
        dataset=MockGPTDatasetConfig(seq_length=SEQ, num_workers=0, split="1,0,0"),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        validation=ValidationConfig(eval_iters=0),
        logger=LoggerConfig(log_interval=1, **trackers),
    )
    timing = Timing()
    pretrain(cfg, forward_step, callbacks=[timing])
    return {"iteration_times": timing.times, "handoff": timing.handoff, "tracker_cpu": timing.tracker_cpu}


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


def tracker_cpu_seconds(tracker) -> float:
    """User+system CPU seconds of the tracker process and its children so far (0 without one)."""
    import psutil

    proc = getattr(tracker, "proc", None)
    if proc is None:
        return 0.0
    total = 0.0
    root = psutil.Process(proc.pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_once(variant: str, iters: int) -> list[float]:
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
        command = [sys.executable, __file__, "--child", variant, "--iters", str(iters), "--workdir", workdir]
        out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    line = next(line for line in out.stdout.splitlines() if line.startswith("BENCH "))
    return json.loads(line[len("BENCH ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument(
        "--in-process",
        action="store_true",
        help="also run the trackers in the training process (logger.tracker_subprocess=False) each round",
    )
    p.add_argument("--child", choices=("none", "all", "in-process", "backends"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "backends":
        print("BENCH " + json.dumps(backend_costs(args.workdir)), flush=True)
        return
    if args.child:
        print("BENCH " + json.dumps(train_once(args.child, args.iters, args.workdir)), flush=True)
        return
    variants = ["none", "all"] + (["in-process"] if args.in_process else [])
    times: dict[str, list[float]] = {v: [] for v in variants}
    per_round: dict[str, list[float]] = {v: [] for v in variants}
    handoff, tracker_cpu, iterations = 0.0, 0.0, 0
    for round_index in range(args.rounds):
        order = list(variants)
        random.Random(round_index).shuffle(order)  # no variant always runs first (machine-state drift)
        for variant in order:
            got = run_once(variant, args.iters)
            steady = got["iteration_times"][WARMUP:]
            times[variant] += steady
            per_round[variant].append(statistics.median(steady))
            if variant == "all":
                handoff += got["handoff"]
                tracker_cpu += got["tracker_cpu"]
                iterations += len(got["iteration_times"])
    labels = {"none": "no trackers", "all": "4 trackers ", "in-process": "4 trackers in the training process"}
    for variant in variants:
        t, label = times[variant], labels[variant]
        rounds = " ".join(f"{x * 1000:.1f}" for x in per_round[variant])
        print(f"{label}: median {statistics.median(t) * 1000:.2f} ms/iteration, mean {statistics.mean(t) * 1000:.2f} "
              f"(round medians: {rounds})")  # fmt: skip
    # Paired by round (neighbouring runs see the same machine load), then the median over rounds.
    ratios = [a / n for a, n in zip(per_round["all"], per_round["none"], strict=True)]
    pooled = statistics.median(times["all"]) / statistics.median(times["none"])
    print(f"round ratios 4 trackers / none: {' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"overhead, wall clock: {100 * (statistics.median(ratios) - 1):+.2f}% (median of round ratios; "
          f"pooled medians: {100 * (pooled - 1):+.2f}%)")  # fmt: skip
    base = statistics.median(times["none"])
    per_iter = handoff / iterations
    if args.in_process:
        ratios = [a / n for a, n in zip(per_round["in-process"], per_round["none"], strict=True)]
        print(
            f"in the training process instead: {100 * (statistics.median(ratios) - 1):+.2f}% (median of round ratios)"
        )
    print(f"training thread, handing metrics to the tracker process: {per_iter * 1e6:.0f} us/iteration "
          f"= {100 * per_iter / base:.2f}% of a no-tracker iteration")  # fmt: skip
    print(f"tracker process (SCHED_IDLE) CPU while training: {tracker_cpu / iterations * 1000:.2f} ms/iteration "
          "(what it did not get to during training, it does while the run closes)")  # fmt: skip
    costs = run_once("backends", args.iters)
    print("backend CPU per log step, each alone: " + ", ".join(f"{name} {sec * 1000:.2f} ms" for name, sec in costs.items())
          + f" (sum {sum(costs.values()) * 1000:.2f} ms = {100 * sum(costs.values()) / base:.1f}% of a no-tracker iteration)")  # fmt: skip
    print(f"target: under 1% at log_interval=1. ({args.rounds} rounds x {args.iters} iterations per run, "
          f"first {WARMUP} excluded, alternating fresh processes)")  # fmt: skip


if __name__ == "__main__":
    main()
