"""The scripts in examples/ run as documented (on CPU, fewer iterations)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys

import pytest
from factories import source_tree_env, started

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run_example(name: str, *argv: str) -> str:
    env = source_tree_env()
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", name), *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _arguments(key: str, directory) -> tuple[str, ...]:
    if key == "custom_dataset":
        text = directory / "corpus.txt"
        text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
        return ("custom_dataset.py", "--text", str(text), "--dir", str(directory), "--train-iters", "6")
    if key == "eval_callback":
        return ("eval_callback.py", "--dir", str(directory), "--train-iters", "20", "--every", "10")
    iters = {"optimizer_groups": "4", "extra_metric": "5", "callback": "20"}[key]
    return (f"{key}.py", "--dir", str(directory), "--train-iters", iters)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every example started at once, two at a time (they are independent; under pytest-xdist each
    when first asked for: `factories.started`): key -> (its directory, a future of its output)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)

    def start(key: str) -> tuple:
        directory = tmp_path_factory.mktemp(key)
        return directory, pool.submit(run_example, *_arguments(key, directory))

    yield started(("custom_dataset", "optimizer_groups", "extra_metric", "callback", "eval_callback"), start)
    pool.shutdown(wait=True)


def test_custom_dataset_provider(runs):
    tmp_path, job = runs["custom_dataset"]
    text = tmp_path / "corpus.txt"
    out = job.result()
    assert f"trained 6 iterations on the bytes of {text}" in out
    assert "validation at iteration 6" in out


def test_optimizer_override_provider(runs):
    out = runs["optimizer_groups"][1].result()
    groups = [line for line in out.splitlines() if line.startswith("group: ")]
    # lr 3e-3 in the tiny recipe: decaying and non-decaying groups at 3e-3, the embedding at 3e-4
    assert any("max_lr 3.00e-04, wd_mult 1.0" in g for g in groups), groups
    assert any("max_lr 3.00e-03, wd_mult 0.0" in g for g in groups), groups
    assert any("max_lr 3.00e-03, wd_mult 1.0" in g for g in groups), groups


def test_forward_step_with_extra_metric(runs):
    tmp_path, job = runs["extra_metric"]
    out = job.result()
    validation = [line for line in out.splitlines() if "validation at iteration 5" in line]
    assert validation and "token accuracy" in validation[0] and "lm loss" in validation[0], out[-2000:]
    assert "trained 5 iterations" in out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "example_metric" / "tb_logs"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "token accuracy" in tags and "lm loss" in tags, tags
    steps = [e.step for e in events.Scalars("token accuracy")]
    assert steps == [5], steps  # log_interval 5: one training log step
    assert all(0.0 <= e.value <= 1.0 for e in events.Scalars("token accuracy"))
    # console lines carry a timestamp, as Megatron-LM's do
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] \[100%\] iteration 5/5", out, re.M), out[-2000:]


def test_callback(runs):
    tmp_path, job = runs["callback"]
    out = job.result()
    record = json.loads((tmp_path / "example_callback" / "best.json").read_text())
    assert len(record["train_losses"]) == 20
    assert record["step"] in (10, 20)
    assert f"best validation loss {record['best_validation_loss']:.4f} at iteration {record['step']}" in out


def test_held_out_evaluation_callback(runs):
    """The callback's last held-out loss is what `mbridge eval` gives the checkpoint of that
    iteration, and training on the counting sequences lowers it."""
    tmp_path, job = runs["eval_callback"]
    out = job.result()
    run = tmp_path / "example_eval_callback"
    history = json.loads((run / "held_out_history.json").read_text())
    assert [h["iteration"] for h in history] == [10, 20]
    assert history[1]["loss"] < history[0]["loss"]
    assert f"held-out loss {history[1]['loss']:.6f}" in out and "at iteration 20" in out
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bridge", "eval", str(run / "checkpoints"), "--data", str(run / "held_out.jsonl"), "--json"],
        cwd=REPO, env=source_tree_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert abs(json.loads(proc.stdout.splitlines()[-1])["loss"] - history[1]["loss"]) < 1e-6
