"""pretrain() under torchrun with 2 processes (`factories.backend_for(2)`: gloo on CPU unless there
is a GPU per process): DP=2, TP=2, PP=2. One-process runs compared with them use the same backend."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from factories import backend_for, torchrun


SCRIPT = Path(__file__).parent / "scripts" / "train_tiny.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def run(tmp_path, name, *args, nproc=1, timeout=300):
    out = tmp_path / name
    if nproc == 1:
        cmd = [sys.executable, str(SCRIPT)]
    else:
        cmd = [
            *torchrun(nproc),
            str(SCRIPT),
        ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([*cmd, *args, "--backend", backend_for(2), "--out", str(out)], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"{name}.rank{r}").read_text()) for r in range(nproc)]
    return results, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    results, _ = run(tmp_path_factory.mktemp("single"), "single")
    return results[0]


def test_tensor_parallel_2_matches_one_process(tmp_path, single):
    results, output = run(tmp_path, "tp2", "--tp", "2", nproc=2)
    for r in results:
        assert r["step"] == 10 and r["dp"] == 1
        assert r["losses"] == pytest.approx(single["losses"], abs=1e-5)
    # the logging rank's params-norm counts TP-split weights once and replicated ones once
    assert len(single["params_norms"]) == 10
    assert results[1]["params_norms"] == pytest.approx(single["params_norms"], rel=1e-5)
    assert "(TP=2 PP=1 CP=1 DP=1)" in output


def test_data_parallel_2_averages_to_one_process(tmp_path, single):
    results, output = run(tmp_path, "dp2", nproc=2)
    assert all(r["dp"] == 2 for r in results)
    # each rank reports its half of the global batch; their mean is the 1-process loss
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert mean == pytest.approx(single["losses"], abs=1e-4)
    assert "[100%] iteration 10/10" in output
    # tokens/s counts the batches of both ranks: 8 sequences of 32 tokens per step
    line = next(x for x in output.splitlines() if "[100%] iteration 10/10" in x)
    ms, tokens_per_s = (float(re.search(p, line).group(1)) for p in (r"([\d.]+) ms/iter", r"(\d+) tokens/s"))
    assert tokens_per_s * ms / 1000 == pytest.approx(8 * 32, rel=0.02)


def test_data_parallel_2_with_distributed_optimizer(tmp_path, single):
    results, _ = run(tmp_path, "dp2do", "--dist-opt", nproc=2)
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert mean == pytest.approx(single["losses"], abs=1e-4)


def test_pipeline_parallel_2_trains(tmp_path):
    results, output = run(tmp_path, "pp2", "--pp", "2", "--iters", "20", nproc=2)
    first, last = results
    assert first["losses"] == []  # the first stage holds no loss
    losses = last["losses"]
    assert len(losses) == 20 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5
    assert "(TP=1 PP=2 CP=1 DP=1)" in output


def test_tensor_parallel_2_checkpoint_resumes_in_one_process(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight, _ = run(tmp_path, "straight", "--iters", "20")
    first, _ = run(tmp_path, "tp2", "--tp", "2", "--iters", "20", "--exit-interval", "10", "--save", ckpt, nproc=2)
    assert first[0]["step"] == 10
    resumed, output = run(tmp_path, "resumed", "--iters", "20", "--load", ckpt)
    assert "resumed from iteration 10" in output
    assert "RNG states not restored: the parallel layout differs" in output
    assert first[0]["losses"] + resumed[0]["losses"] == pytest.approx(straight[0]["losses"], abs=1e-5)


def test_one_rank_raising_stops_both_quickly_with_its_error(tmp_path):
    import time

    cmd = [
        *torchrun(2), str(SCRIPT), "--iters", "50", "--fail-at", "5", "--fail-rank", "1",
        "--timeout-minutes", "1", "--backend", backend_for(2), "--out", str(tmp_path / "o"),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    elapsed = time.time() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "injected failure at iteration 5 on rank 1" in output
    assert elapsed < 60 + 30  # within distributed_timeout_minutes (plus start-up), not a hang
    assert not list(tmp_path.glob("o.rank*"))  # neither rank finished training
