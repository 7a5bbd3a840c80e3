"""Profiling and tensor inspection."""

from __future__ import annotations

import functools
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Optional, Union

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import STEPS, Unsupported, field


_TENSOR_INSPECT = Unsupported(
    "tensor inspection is not implemented (it needs TransformerEngine's debug API, nvdlfw_inspect)"
)

@config_dataclass(kw_only=True)
class ProfilingConfig(ConfigBase):
    """Configuration settings for profiling the training process."""

    use_nsys_profiler: bool = False
    """Mark the profiled step range for Nsight Systems (run under `nsys profile -c cudaProfilerApi`)."""

    use_pytorch_profiler: bool = False
    """Record the profiled step range with the PyTorch profiler (Chrome/Perfetto trace files)."""

    profile_step_start: int = field(10, range=STEPS)
    """First iteration profiled."""

    profile_step_end: int = field(12, range=STEPS)
    """Iteration after the last one profiled."""

    profile_ranks: list[int] = field(default_factory=lambda: [0], range=STEPS)
    """Global ranks that profile."""

    profile_dir: Optional[str] = None
    """Where PyTorch profiler traces go (default: `<tensorboard_dir or save>/profile`, else ./profile)."""

    record_memory_history: bool = False
    """Record CUDA memory history and dump a snapshot (GPU only)."""

    memory_snapshot_path: str = "snapshot.pickle"
    """File for the CUDA memory snapshot."""

    record_shapes: bool = False
    """Record tensor shapes in the PyTorch profiler."""

    nvtx_ranges: bool = False
    """Emit NVTX ranges around forward/backward/optimizer (GPU only)."""

    def _finalize(self, problems: Problems) -> None:
        problems.check(
            not (self.use_nsys_profiler and self.use_pytorch_profiler),
            "use_pytorch_profiler",
            "use_nsys_profiler and use_pytorch_profiler are both on",
            "enable one profiler at a time",
        )
        self._check_settings_of_profilers_that_are_off(problems)
        if self.use_nsys_profiler or self.use_pytorch_profiler or self.record_memory_history:
            # profile_step_start and profile_ranks are >= 0 by their declared ranges
            problems.check(
                self.profile_step_end > self.profile_step_start,
                "profile_step_end",
                f"profile_step_end ({self.profile_step_end}) must be greater than "
                f"profile_step_start ({self.profile_step_start})",
                "set profiling.profile_step_end above profile_step_start",
            )

    def _check_settings_of_profilers_that_are_off(self, problems: Problems) -> None:
        """The window, ranks and outputs are read only by the profilers that use them: set while
        those are off, nothing would be profiled and nothing would say why."""
        any_profiler = ("use_pytorch_profiler", "use_nsys_profiler", "record_memory_history")
        defaults = _defaults(type(self))
        for name, switches in (
            ("profile_step_start", any_profiler),
            ("profile_step_end", any_profiler),
            ("profile_ranks", any_profiler),
            ("profile_dir", ("use_pytorch_profiler",)),
            ("record_shapes", ("use_pytorch_profiler", "use_nsys_profiler")),
            ("memory_snapshot_path", ("record_memory_history",)),
        ):
            value = getattr(self, name)
            if value == defaults[name] or any(getattr(self, s) for s in switches):
                continue
            named = " or ".join(f"profiling.{s}" for s in switches)
            problems.add(
                name,
                f"{value!r} has no effect: no profiler that reads it is on ({named})",
                f"turn on {named}, or remove profiling.{name}",
            )


@functools.lru_cache(maxsize=None)
def _defaults(cls: type) -> dict[str, Any]:
    """The default of every field of `cls` (compared with, never changed)."""
    return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default for f in fields(cls)}


def check_profiled_window(cfg: Any, problems: Problems) -> None:
    """A profiler that is on profiles something: its window holds an iteration (they are numbered
    from 1) that the run reaches, and one of `profile_ranks` is a rank of the run. Otherwise no
    trace would be written, and nothing would say why."""
    p = cfg.profiling
    if not (p.use_nsys_profiler or p.use_pytorch_profiler or p.record_memory_history):
        return
    last = cfg.train.train_iters
    first = max(1, p.profile_step_start)
    if p.profile_step_end <= p.profile_step_start:
        pass  # reported by the section
    elif p.profile_step_end <= first:
        problems.add(
            "profiling.profile_step_end",
            f"iterations {p.profile_step_start} to {p.profile_step_end - 1} hold none of the run's "
            "(they are numbered from 1, as the console shows them)",
            "set profiling.profile_step_end to 2 or more (start=1, end=2 profiles the first iteration)",
        )
    elif last is not None:
        problems.check(
            first <= last,
            "profiling.profile_step_start",
            f"the profiled iterations start at {first}, after the run's last iteration ({last})",
            f"set profiling.profile_step_start and profile_step_end within the run, e.g. 1 and {min(last, 2) + 1}",
        )
    m, dp = cfg.model, cfg.data_parallel_size
    if dp is not None:
        world = dp * m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        problems.check(
            any(rank < world for rank in p.profile_ranks),
            "profiling.profile_ranks",
            f"none of {list(p.profile_ranks)} is a rank of this {world}-process run",
            f"use ranks from 0 to {world - 1}",
        )


@config_dataclass(kw_only=True)
class TensorInspectConfig(ConfigBase):
    """Configuration for Nvidia-DL-Framework-Inspect integration."""

    enabled: bool = field(False, status=_TENSOR_INSPECT)
    """Enable tensor inspection and statistics collection."""

    features: Optional[Union[dict[str, Any], str, Path]] = field(None, status=_TENSOR_INSPECT)
    """Feature configuration as a Python dict or a YAML file path."""

    feature_dirs: Optional[list[str]] = field(None, status=_TENSOR_INSPECT)
    """Directories containing feature implementations (searched recursively)."""

    log_dir: Optional[str] = field(None, status=_TENSOR_INSPECT)
    """Root directory to store inspection logs/statistics. Defaults to checkpoint save dir if unset."""

    init_training_step: int = field(0, range=STEPS, status=_TENSOR_INSPECT)
    """Initial training step for the inspector (used when resuming)."""
