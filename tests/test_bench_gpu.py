"""tools/bench_gpu.py runs on CPU with its tiny shape (so the GPU benchmark cannot rot)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from factories import source_tree_env

BENCH = Path(__file__).parent.parent / "tools" / "bench_gpu.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_benchmark_runs_on_cpu_with_the_tiny_shape():
    # `unfused` is pretrain() with attention_backend=unfused and selective recompute: its config is
    # planned in test_planner_activations.py and trained in test_attention_training.py
    variants = ("handwritten", "pretrain", "lora")
    out = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--rounds", "1", "--iters", "2", "--warmup", "1",
         "--variants", ",".join(variants)],
        capture_output=True,
        text=True,
        timeout=580,
        env=source_tree_env(CUDA_VISIBLE_DEVICES=""),  # on CPU also where GPUs are visible (the GPU lane measures them)
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "layers: megatron-core local, SDPA core attention" in text
    summary = text.index("medians over all rounds:")
    for variant in variants:
        # each run's line comes as it ends (before the summary), then the medians
        run = re.search(rf"^{re.escape(variant)} \(1/1\)\s+median\s+([\d.]+) ms/iteration", text, re.M)
        assert run and run.start() < summary, text
        match = re.search(rf"^{re.escape(variant)}\s+median\s+([\d.]+) ms/iteration\s+(\d+) tokens/s", text, re.M)
        assert match and match.start() > summary and float(match.group(1)) > 0 and int(match.group(2)) > 0, text
    for variant in ("pretrain", "lora"):
        assert re.search(rf"^{variant}\s+median .* planner 0\.00\d+ GiB \(no CUDA: not measured\)", text, re.M), text
    assert "pretrain+trackers" not in text and "unfused" not in text.split("shape:")[1]
    assert re.search(r"ratio pretrain\(\)/hand-written per iteration: \d+\.\d{3}", text)
    assert re.search(r"LoRA/full training time per iteration: \d+\.\d{3}", text)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trackers", "neptune"], "unknown trackers ['neptune']"),
        (["--variants", "pretrain,flash"], "unknown variants ['flash']; choose from handwritten, pretrain"),
    ],
)
def test_unknown_tracker_or_variant_is_refused(argv, message):
    out = subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr


def test_the_fused_variant_is_refused_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, str(BENCH), "--variants", "pretrain,fused"], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 2
    assert "the fused variant needs CUDA: megatron-core's fused SwiGLU and cross-entropy are GPU kernels" in out.stderr


def test_counts_that_time_nothing_are_refused():
    for argv, message in (
        (["--rounds", "0"], "--rounds 0: give at least 1"),
        (["--iters", "-1"], "--iters -1: give at least 1"),
        (["--warmup", "-1"], "--warmup -1: give 0 or more, fewer than --iters (30)"),
        (["--iters", "3", "--warmup", "3"], "--warmup 3: give 0 or more, fewer than --iters (3)"),
    ):
        out = subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (argv, out.stderr[-2000:])
        assert "Traceback" not in out.stderr
