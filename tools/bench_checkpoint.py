"""Checkpoint save/load throughput of pretrain()'s checkpoint manager against direct
`dist_checkpointing.save/load` of the same sharded state, side by side in one process.

    python tools/bench_checkpoint.py [--rounds 3] [--layers 8] [--hidden 512] [--dir /tmp/bench_ckpt]
    python tools/bench_checkpoint.py --tiny-only     # just the tiny-model line

First, in a fresh process: the save time of the tiny recipe's model (360k parameters), its first
save (what a short run's final save costs: nothing is set up yet) and the median of the next ones.

Builds a GPT (model + Adam state) with megatron_bridge's setup, then alternates (same number of writer
threads on both sides): the manager's save
(staging directory, commit by rename, tracker, run_config.yaml) vs `dist_checkpointing.save`, and the
manager's load (architecture check, model/optimizer/scheduler/RNG restore) vs `dist_checkpointing.load`.
Prints MB/s (median over rounds) and the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time


def dir_megabytes(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total / 1e6


def tiny_save_times(directory: str, saves: int = 5) -> list[float]:
    """Seconds of each of `saves` saves of the tiny recipe's model (after one training step), in
    this process: the first one is the first save this process makes."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_bridge.cli.source import build_config
    from megatron_bridge.training.checkpointing.manager import DefaultCheckpointManager
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.runner import _shutdown
    from megatron_bridge.training.setup import setup
    from megatron_bridge.training.train import train_step

    shutil.rmtree(directory, ignore_errors=True)
    overrides = ["train.train_iters=1", "logger.tensorboard_dir=null", "validation.eval_iters=0"]
    cfg = build_config("tiny_gpt_pretrain_config", (), {"dir": directory}, None, overrides)
    run = setup(cfg, forward_step)
    try:
        train_step(run, get_forward_backward_func())
        manager = DefaultCheckpointManager(cfg)
        times = []
        for r in range(saves):
            run.state.train_state.step = r + 1
            start = time.perf_counter()
            manager.save(run, "benchmark")
            times.append(time.perf_counter() - start)
    finally:
        _shutdown(run.state)
        shutil.rmtree(directory, ignore_errors=True)
    return times


def tiny_line(directory: str) -> str:
    """The tiny-model line, measured in a fresh process (a first save pays for any set-up)."""
    import subprocess

    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--tiny-only", "--dir", directory],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--dir", default="/tmp/bench_ckpt")
    p.add_argument("--writers", type=int, default=1, help="writer threads per rank, for both (checkpoint.storage_writers_per_rank)")
    p.add_argument("--tiny-only", action="store_true", help="only the tiny-model save line (in this process)")
    args = p.parse_args()
    if args.tiny_only:
        times = tiny_save_times(os.path.join(args.dir, "tiny"))
        later = statistics.median(times[1:])
        print(f"tiny-model save (360k parameters): first {times[0]:.3f} s, then median {later:.3f} s "
              f"({', '.join(f'{t:.3f}' for t in times)})")  # fmt: skip
        return
    print(tiny_line(os.path.join(args.dir, "tiny")), flush=True)

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.runtime.checkpointing import layout, weights
    from megatron_bridge.training.checkpointing import state_dict
    from megatron_bridge.training.checkpointing.manager import DefaultCheckpointManager
    from megatron_bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        MockGPTDatasetConfig,
        OptimizerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.runner import _shutdown
    from megatron_bridge.training.setup import setup
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    shutil.rmtree(args.dir, ignore_errors=True)
    ours_dir, direct_dir = os.path.join(args.dir, "manager"), os.path.join(args.dir, "direct")
    cfg = ConfigContainer(
        model=GPTModelProvider(
            num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8, seq_length=128,
            position_embedding_type="rope", transformer_impl="local",
        ),  # fmt: skip
        train=TrainingConfig(train_iters=1, global_batch_size=2, micro_batch_size=1),
        optimizer=OptimizerConfig(lr=1e-4),
        dataset=MockGPTDatasetConfig(seq_length=128, num_workers=0),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=32000),
        validation=ValidationConfig(eval_iters=0),
        checkpoint=CheckpointConfig(save=ours_dir, load=ours_dir, storage_writers_per_rank=args.writers),
    )
    run = setup(cfg, forward_step)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_bridge.training.train import train_step

    train_step(run, get_forward_backward_func())  # one step, so the optimizer state exists
    manager = DefaultCheckpointManager(cfg)
    params = sum(p.numel() for chunk in run.model for p in chunk.parameters())
    times = {"save manager": [], "save direct": [], "load manager": [], "load direct": []}
    sizes = {}
    def save_manager(r: int) -> None:
        run.state.train_state.step = r + 2  # 1, 2, ...: a new iteration each round
        manager.save(run, "benchmark")
        sizes["manager"] = dir_megabytes(layout.iteration_dir(ours_dir, r + 2))

    def save_direct(r: int) -> None:
        run.state.train_state.step = r + 2
        target = os.path.join(direct_dir, f"round{r}")
        os.makedirs(target, exist_ok=True)
        sd = state_dict.build(run, for_loading=False, with_optimizer=True, with_rng=True, with_common=True)
        dist_checkpointing.save(sd, target, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=args.writers))
        sizes["direct"] = dir_megabytes(target)

    def load_manager(r: int) -> None:
        manager.load(run)

    def load_direct(r: int) -> None:
        target = os.path.join(direct_dir, f"round{r}")
        template = state_dict.build(run, for_loading=True, with_optimizer=True, with_rng=True, with_common=False)
        loaded = dist_checkpointing.load(template, target)
        for key, chunk in zip(state_dict.model_keys(run), run.model):
            weights.unwrap(chunk).load_state_dict(loaded[key])
        run.optimizer.load_state_dict(loaded["optimizer"])

    def timed(name: str, fn, r: int) -> None:
        start = time.perf_counter()
        fn(r)
        if r >= 0:
            times[name].append(time.perf_counter() - start)

    try:
        for r in range(-1, args.rounds):  # round -1 warms both paths up and is not timed
            pairs = [("save manager", save_manager), ("save direct", save_direct)]
            loads = [("load manager", load_manager), ("load direct", load_direct)]
            if r % 2:  # alternate which path goes first
                pairs.reverse()
                loads.reverse()
            for name, fn in pairs + loads:
                timed(name, fn, r)
            shutil.rmtree(os.path.join(direct_dir, f"round{r}"), ignore_errors=True)
    finally:
        _shutdown(run.state)
    print(f"model: {params / 1e6:.1f}M parameters; checkpoint {sizes['manager']:.0f} MB (manager), {sizes['direct']:.0f} MB (direct)")
    rate = {}
    for name, values in times.items():
        kind = name.split()[1]
        seconds = statistics.median(values)
        rate[name] = sizes[kind] / seconds
        print(f"{name:13s} median {seconds:6.2f} s  {rate[name]:7.1f} MB/s   ({', '.join(f'{v:.2f}' for v in values)})")
    print(f"throughput manager/direct: save {rate['save manager'] / rate['save direct']:.3f}, "
          f"load {rate['load manager'] / rate['load direct']:.3f}  ({args.rounds} rounds, alternating)")  # fmt: skip
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
