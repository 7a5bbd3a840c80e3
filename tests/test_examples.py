"""The scripts in examples/ run as documented (on CPU, fewer iterations)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run_example(name: str, *argv: str) -> str:
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", name), *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_custom_dataset_provider(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = run_example("custom_dataset.py", "--text", str(text), "--dir", str(tmp_path), "--train-iters", "6")
    assert f"trained 6 iterations on the bytes of {text}" in out
    assert "validation at iteration 6" in out


def test_optimizer_override_provider(tmp_path):
    out = run_example("optimizer_groups.py", "--dir", str(tmp_path), "--train-iters", "4")
    groups = [line for line in out.splitlines() if line.startswith("group: ")]
    # lr 3e-3 in the tiny recipe: decaying and non-decaying groups at 3e-3, the embedding at 3e-4
    assert any("max_lr 3.00e-04, wd_mult 1.0" in g for g in groups), groups
    assert any("max_lr 3.00e-03, wd_mult 0.0" in g for g in groups), groups
    assert any("max_lr 3.00e-03, wd_mult 1.0" in g for g in groups), groups


def test_forward_step_with_extra_metric(tmp_path):
    out = run_example("extra_metric.py", "--dir", str(tmp_path), "--train-iters", "5")
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


def test_callback(tmp_path):
    out = run_example("callback.py", "--dir", str(tmp_path), "--train-iters", "20")
    record = json.loads((tmp_path / "example_callback" / "best.json").read_text())
    assert len(record["train_losses"]) == 20
    assert record["step"] in (10, 20)
    assert f"best validation loss {record['best_validation_loss']:.4f} at iteration {record['step']}" in out
