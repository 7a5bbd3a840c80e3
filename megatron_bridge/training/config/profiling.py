"""Profiling and tensor inspection."""

from __future__ import annotations

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
        if self.use_nsys_profiler or self.use_pytorch_profiler or self.record_memory_history:
            # profile_step_start and profile_ranks are >= 0 by their declared ranges
            problems.check(
                self.profile_step_end > self.profile_step_start,
                "profile_step_end",
                f"profile_step_end ({self.profile_step_end}) must be greater than "
                f"profile_step_start ({self.profile_step_start})",
                "set profiling.profile_step_end above profile_step_start",
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
