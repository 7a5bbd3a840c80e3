"""tools/profile_step.py: a training step's time by part of the model."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)

import profile_step  # noqa: E402


class ColumnParallelLinear(torch.nn.Linear):
    pass


class DotProductAttention(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x @ x.transpose(-1, -2), dim=-1) @ x


class SelfAttention(torch.nn.Module):
    """A linear layer, an op of its own, and core attention recomputed in backward."""

    def __init__(self):
        super().__init__()
        self.linear_qkv = ColumnParallelLinear(8, 8)
        self.core_attention = DotProductAttention()

    def forward(self, x):
        h = self.linear_qkv(x).flip(-1)
        return checkpoint(self.core_attention, h, use_reentrant=True)


def test_ops_count_with_their_part_in_forward_backward_and_recomputation():
    model = SelfAttention()
    profile_step.label_model(model)
    x = torch.randn(2, 4, 8, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).square().sum().backward()
    parts: dict[str, set[str]] = {}
    for event, part in profile_step.attribute(prof.events()):
        parts.setdefault(event.name, set()).add(part)
    # softmax forward twice (the forward, then its recomputation in backward) and its backward
    assert parts["aten::_softmax"] == {"core attention"}
    assert parts["aten::_softmax_backward_data"] == {"core attention"}
    assert parts["aten::addmm"] == {"GEMMs"}
    assert "GEMMs" in parts["aten::mm"]  # the linear layer's weight and input gradients
    assert parts["aten::flip"] == {"rotary and head reshapes"}  # the block's own op, and its backward
    assert parts["aten::square"] == {"outside the model"}
    totals = profile_step.breakdown(prof.events(), cuda=False)
    assert set(totals) == {"GEMMs", "core attention", "rotary and head reshapes", "outside the model",
                           "gradient accumulation"}  # fmt: skip


@pytest.mark.timeout(300)
def test_the_breakdown_covers_a_pretrain_step():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the tiny shape on CPU, on any machine
    out = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "profile_step.py"), "--steps", "1", "--warmup", "1"],
        capture_output=True, text=True, env=env, timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = dict(
        (m.group(1), (float(m.group(2)), float(m.group(3))))
        for m in re.finditer(r"^  (\S.*?)\s+([\d.]+) ms/step\s+([\d.]+)%$", out.stdout, re.M)
    )
    model_parts = {"GEMMs", "GEMM output layer", "core attention", "norms", "activation (SwiGLU)",
                   "rotary and head reshapes", "embedding", "loss (cross-entropy)", "optimizer"}  # fmt: skip
    assert model_parts <= set(rows), out.stdout
    assert set(rows) <= set(profile_step.PARTS), out.stdout
    assert all(rows[p][0] > 0 for p in model_parts), out.stdout
    assert abs(sum(share for _, share in rows.values()) - 100) < 0.5, out.stdout
    assert rows.get("outside the model", (0, 0))[1] < 30, out.stdout  # nearly all the step is placed
    assert "1 steps profiled after 1" in out.stdout


def test_step_counts_that_profile_nothing_are_refused():
    for argv, message in ((["--steps", "0"], "--steps 0: give at least 1"), (["--warmup", "-1"], "--warmup -1: give 0 or more")):
        out = subprocess.run([sys.executable, os.path.join(TOOLS, "profile_step.py"), *argv], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert out.returncode == 2 and message in out.stderr, (argv, out.stderr[-2000:])
        assert "Traceback" not in out.stderr
