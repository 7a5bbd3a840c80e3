"""Profiling a window of training steps on the ranks in `profiling.profile_ranks`.

The window is iterations `profile_step_start` to `profile_step_end - 1`, numbered as the console
numbers them (from 1): start=10, end=12 profiles iterations 10 and 11.

- PyTorch profiler: one Chrome/Perfetto trace per rank, `<profile_dir>/rank<R>.<time>.pt.trace.json`
  (opens in https://ui.perfetto.dev, chrome://tracing and TensorBoard's profile plugin). The
  step before the window, if any, warms the profiler up.
- Nsight Systems (GPU): cudaProfilerStart/Stop around the window, for `nsys profile -c cudaProfilerApi`,
  with NVTX ranges from autograd.
- CUDA memory history (GPU): recorded over the window and dumped to `memory_snapshot_path`
  (open in https://pytorch.org/memory_viz).
- `nvtx_ranges` (GPU): an NVTX range per iteration, on every iteration.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Optional

logger = logging.getLogger("megatron_bridge")


def default_profile_dir(cfg: Any) -> str:
    """`profiling.profile_dir`, else `<tensorboard_dir>/profile`, `<checkpoint.save>/profile`, ./profile."""
    if cfg.profiling.profile_dir:
        return cfg.profiling.profile_dir
    base = cfg.logger.tensorboard_dir or cfg.checkpoint.save or "."
    return os.path.join(base, "profile")


class StepProfiler:
    """Start/stop the configured profilers at step boundaries (does nothing when none is on)."""

    def __init__(self, cfg: Any, rank: int, device: str):
        p = cfg.profiling
        self.enabled = rank in p.profile_ranks and (
            p.use_pytorch_profiler or p.use_nsys_profiler or p.record_memory_history
        )
        self.nvtx = p.nvtx_ranges and device == "cuda"
        # first and last iteration profiled (1-based)
        self.first, self.last = max(1, p.profile_step_start), p.profile_step_end - 1
        self.cfg, self.rank, self.device = cfg, rank, device
        self.torch_profiler: Any = None
        self.nsys: Optional[contextlib.ExitStack] = None
        self.memory = False
        self.done = False

    @classmethod
    def for_run(cls, state: Any) -> "StepProfiler":
        return cls(state.cfg, state.rank, state.device)

    def step_start(self, completed: int) -> None:
        """Before iteration `completed + 1`."""
        iteration = completed + 1
        if self.nvtx:
            import torch

            torch.cuda.nvtx.range_push(f"iteration {iteration}")
        if not self.enabled or self.done:
            return
        wants_torch = self.cfg.profiling.use_pytorch_profiler and self.torch_profiler is None
        if wants_torch and self.first - 1 <= iteration <= self.last:
            # the iteration before the window, if there is one, warms the profiler up
            warmup = 1 if iteration < self.first else 0
            self._start_torch_profiler(warmup, active=self.last - max(self.first, iteration) + 1)
        if self.first <= iteration <= self.last and self.nsys is None and not self.memory:
            self._start_gpu_tools()

    def step_end(self, completed: int) -> None:
        """After iteration `completed`."""
        if self.nvtx:
            import torch

            torch.cuda.nvtx.range_pop()
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        if completed >= self.last and self.enabled and not self.done:
            self.close()

    def close(self) -> None:
        """Stop whatever runs and write its output (also when training stops inside the window)."""
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            logger.info("PyTorch profiler trace written to %s", self.trace_dir)
            self.torch_profiler = None
        if self.nsys is not None:
            self.nsys.close()
            self.nsys = None
        if self.memory:
            self._dump_memory_snapshot()
        self.done = self.enabled

    # ------------------------------------------------------------------ internals
    @property
    def trace_dir(self) -> str:
        return default_profile_dir(self.cfg)

    def _start_torch_profiler(self, warmup: int, active: int) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(self.trace_dir, exist_ok=True)
        self.torch_profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{self.rank}"),
            record_shapes=self.cfg.profiling.record_shapes,
        )
        self.torch_profiler.start()

    def _start_gpu_tools(self) -> None:
        if self.device != "cuda":
            return  # cpu_backend.adapt_config rejects the GPU-only tools on CPU
        import torch

        p = self.cfg.profiling
        if p.record_memory_history and not self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.memory = True
        if p.use_nsys_profiler:
            stack = contextlib.ExitStack()
            torch.cuda.cudart().cudaProfilerStart()
            stack.callback(torch.cuda.cudart().cudaProfilerStop)
            stack.enter_context(torch.autograd.profiler.emit_nvtx(record_shapes=p.record_shapes))
            self.nsys = stack

    def _dump_memory_snapshot(self) -> None:
        import torch

        path = self.cfg.profiling.memory_snapshot_path
        if not os.path.isabs(path):
            path = os.path.join(self.trace_dir, path)
        if len(self.cfg.profiling.profile_ranks) > 1:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{self.rank}{ext}"
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        self.memory = False
        logger.info("CUDA memory snapshot written to %s", path)
