"""tools/gpu_check.sh: its refusal without the carried wheels (the steps themselves run on a GPU
machine, or at tiny size with --cpu-smoke)."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "tools" / "gpu_check.sh"


def test_missing_wheels_stop_the_check_with_the_download_command(tmp_path):
    empty = tmp_path / "whl"
    empty.mkdir()
    logs = tmp_path / "logs"
    env = dict(os.environ, WHL_DIR=str(empty))
    cmd = ["bash", str(SCRIPT), "--cpu-smoke", str(logs)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2
    assert f"no megatron-core and omegaconf wheels in {empty}" in out.stderr
    assert "-d .whl megatron-core==0.16.1 omegaconf==2.4.0" in out.stderr
    summary = (logs / "summary.txt").read_text()
    assert "smoke=1" in summary and "no megatron-core and omegaconf wheels" in summary


def test_help_shows_the_steps():
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "--cpu-smoke" in out.stdout and "pytest -m gpu" in out.stdout and "summary.txt" in out.stdout


def test_unknown_option_or_extra_argument_is_refused(tmp_path):
    for args in (["--bogus"], ["--cpu-smoke", "--log"], [str(tmp_path / "a"), str(tmp_path / "b")]):
        out = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert out.returncode == 2, (args, out.stderr)
        given = " ".join(a for a in args if a != "--cpu-smoke")
        assert f"unexpected arguments: {given}" in out.stderr, out.stderr
        assert "usage: bash tools/gpu_check.sh [--cpu-smoke] [LOG_DIR]" in out.stderr
        assert not any(tmp_path.iterdir()), "no log directory is made for a refused command line"
