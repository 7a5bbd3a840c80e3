"""tools/bench_gpu.py runs on CPU with its tiny shape (so the GPU benchmark cannot rot)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "tools" / "bench_gpu.py"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_gpu_benchmark_runs_on_cpu_with_the_tiny_shape():
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--tiny",
            "--rounds",
            "1",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--trackers",
            "tensorboard",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "layers: megatron-core local" in text
    for variant in ("handwritten", "pretrain", "pretrain+trackers"):
        match = re.search(rf"^{re.escape(variant)}\s+median\s+([\d.]+) ms/iteration\s+(\d+) tokens/s", text, re.M)
        assert match and float(match.group(1)) > 0 and int(match.group(2)) > 0, text
    assert re.search(r"pretrain\s+median .* planner 0\.00\d+ GiB \(no CUDA: not measured\)", text)
    assert re.search(r"ratio pretrain\(\)/hand-written per iteration: \d+\.\d{3}", text)
    assert re.search(r"trackers on/off per iteration \(tensorboard, logging every iteration\): \d+\.\d{3}", text)


def test_unknown_tracker_is_refused():
    out = subprocess.run(
        [sys.executable, str(BENCH), "--trackers", "neptune"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "unknown trackers ['neptune']" in out.stderr
