"""`ConfigContainer`: every section of a run in one object."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional, Union

from megatron_bridge.models.gpt_provider import GPTModelProvider
from megatron_bridge.training.comm_overlap import CommOverlapConfig
from megatron_bridge.config.base import ConfigBase, config_dataclass, values_equal
from megatron_bridge.config.fields import SIZE, field
from megatron_bridge.training.config.checkpoint import CheckpointConfig
from megatron_bridge.data.config import DatasetProvider, FinetuningDatasetConfig, GPTDatasetConfig
from megatron_bridge.training.config.distributed import DistributedDataParallelConfig, DistributedInitConfig, RNGConfig
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.schema import NO_DEFAULT, specs
from megatron_bridge.config.secrets import printable
from megatron_bridge.training.config.logger import LoggerConfig
from megatron_bridge.training.config.loop import TrainingConfig, ValidationConfig
from megatron_bridge.training.config.optimizer import OptimizerConfig, OptimizerConfigOverrideProvider
from megatron_bridge.training.config.profiling import ProfilingConfig, TensorInspectConfig
from megatron_bridge.training.config.resiliency import (
    FaultToleranceConfig,
    InProcessRestartConfig,
    NVRxStragglerDetectionConfig,
    RerunStateMachineConfig,
    StragglerDetectionConfig,
)
from megatron_bridge.training.config.scheduler import SchedulerConfig
from megatron_bridge.peft.config import DoRA, LoRA
from megatron_bridge.training.mixed_precision import MixedPrecisionConfig
from megatron_bridge.runtime.tokenizers.config import TokenizerConfig
from megatron_bridge.config.serialization import from_dict, from_yaml, to_dict, to_yaml
from megatron_bridge.training.config.runtime import current_world_size, validate_into

logger = logging.getLogger(__name__)

@config_dataclass(kw_only=True)
class ConfigContainer(ConfigBase):
    """Top-level container holding all configuration objects of a run."""

    train: TrainingConfig
    """Training loop: length, batch sizes, exit conditions."""

    model: GPTModelProvider
    """Model architecture and parallel layout (builds the model)."""

    optimizer: OptimizerConfig
    """Optimizer settings."""

    dataset: Union[GPTDatasetConfig, FinetuningDatasetConfig, DatasetProvider]
    """Dataset and dataloader settings."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate and weight-decay schedule."""

    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Console and tracker logging."""

    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint saving and loading."""

    rng: RNGConfig = field(default_factory=RNGConfig)
    """Random seeds."""

    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    """Result validation (NaN/spiky loss checks, re-runs)."""

    optimizer_config_override_provider: OptimizerConfigOverrideProvider = field(
        default_factory=OptimizerConfigOverrideProvider
    )
    """Decides per-parameter-group optimizer settings."""

    ddp: DistributedDataParallelConfig = field(default_factory=DistributedDataParallelConfig)
    """Data-parallel wrapping of the model."""

    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Evaluation schedule."""

    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    """Process-group initialization."""

    ft: Optional[FaultToleranceConfig] = None
    """Fault tolerance with nvidia-resiliency-ext."""

    straggler: Optional[StragglerDetectionConfig] = None
    """megatron-core straggler detection."""

    nvrx_straggler: Optional[NVRxStragglerDetectionConfig] = None
    """nvidia-resiliency-ext straggler detection."""

    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    """Profilers."""

    peft: Optional[Union[LoRA, DoRA]] = None
    """Parameter-efficient fine-tuning (LoRA or DoRA adapters on checkpoint.pretrained_checkpoint).

    On the command line `peft=lora` or `peft=dora` creates one with its defaults."""

    comm_overlap: Optional[CommOverlapConfig] = None
    """Communication overlap (None: leave model/ddp/optimizer settings as they are)."""

    mixed_precision: Optional[Union[MixedPrecisionConfig, str]] = None
    """Mixed-precision preset name (e.g. 'bf16_mixed') or config (None: keep the fields as set)."""

    tensor_inspect: Optional[TensorInspectConfig] = None
    """Tensor statistics collection."""

    inprocess_restart: Optional[InProcessRestartConfig] = None
    """In-process restart with nvidia-resiliency-ext."""

    env_vars: dict[str, Any] = field(default_factory=dict)
    """Environment variables set (if not already set) by runtime_config_update. Variables that
    make a process load code (PYTHONPATH, LD_PRELOAD, BASH_ENV, ...) are refused: set those in
    the launching environment. Values named like credentials (`*_TOKEN`, `*_KEY`, ...) are
    written to saved configs as `<redacted>`; give them as `${oc.env:VAR}` to keep a reference."""

    recipe_world_size: Optional[int] = field(None, range=SIZE)
    """Processes (GPUs) the config is laid out for, recorded by its recipe; dry runs and plans use
    it when no world size is given."""

    data_parallel_size: Optional[int] = field(init=False, default=None, range=SIZE)
    """Derived: world size // (TP x PP x CP), set by runtime_config_update."""

    # ------------------------------------------------------------------ derived sizes
    def get_data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size for `world_size` ranks (raises ValueError if it does not divide)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size {world_size!r} is not a positive number of processes")
        m = self.model
        model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        if model_parallel <= 0 or world_size % model_parallel != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor x pipeline x context parallel "
                f"= {m.tensor_model_parallel_size} x {m.pipeline_model_parallel_size} x {m.context_parallel_size}"
            )
        return world_size // model_parallel

    def set_data_parallel_size(self, world_size: Optional[int] = None, problems: Optional[Problems] = None) -> None:
        """Compute `data_parallel_size` (and the comm-overlap copy of it) for `world_size`."""
        world = current_world_size() if world_size is None else world_size
        try:
            dp = self.get_data_parallel_size(world)
        except ValueError as exc:
            if problems is None:
                raise
            problems.add(
                "data_parallel_size",
                str(exc),
                "launch a multiple of TP x PP x CP processes or change the parallel sizes",
            )
            return
        if self.is_explicit("data_parallel_size") and self.data_parallel_size != dp:
            if problems is None:
                raise ValueError(f"data_parallel_size={self.data_parallel_size} but the layout gives {dp}")
            problems.add(
                "data_parallel_size",
                f"set to {self.data_parallel_size}, but {world} ranks with TP x PP x CP = "
                f"{world // dp} give {dp}",
                "leave data_parallel_size unset (it is derived), or launch the matching number of ranks",
            )
            return
        self.apply_default("data_parallel_size", dp)
        if self.comm_overlap is not None:
            self.comm_overlap.apply_default("data_parallel_size", dp)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Run the validation rules (`mbridge config rules`): finalize every section, derive values,
        check across sections; raise one `ConfigValidationError` listing every problem found."""
        problems = Problems()
        self.validate_into(problems)
        problems.raise_if_any()

    def validate_into(self, problems: Problems) -> None:
        """`validate()`, collecting into `problems` instead of raising."""
        validate_into(self, problems)

    # ------------------------------------------------------------------ reporting
    def log_non_default_values(self) -> dict[str, dict[str, tuple[Any, Any]]]:
        """Log (and return) per section the fields whose value differs from the default:
        megatron-core's default for fields megatron-core defines, the section's own otherwise.
        Values that finalize derived from other fields are left out."""
        report: dict[str, dict[str, tuple[Any, Any]]] = {}
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if not dataclasses.is_dataclass(section):
                continue
            diff = non_default_values(section)
            if diff:
                report[f.name] = diff
                lines = ", ".join(f"{k}={printable(k, v[0])} (default {v[1]!r})" for k, v in diff.items())
                logger.info("%s: %s", f.name, lines)
        return report

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (with `_target_` class paths) that `from_dict` turns back into this."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ConfigContainer":
        """Rebuild a container from `to_dict()` output (or hand-written equivalent)."""
        return from_dict(data, cls)

    def to_yaml(self, path: Optional[Union[str, os.PathLike]] = None) -> str:
        """YAML text of this config; also written to `path` when given."""
        return to_yaml(self, path)

    @classmethod
    def from_yaml(cls, path: Union[str, os.PathLike]) -> "ConfigContainer":
        """Load a container from a YAML file written by `to_yaml` (or by hand)."""
        return from_yaml(path, cls)

    def print_yaml(self) -> None:
        """Print this config as YAML."""
        print(self.to_yaml(), end="")


def non_default_values(obj: Any) -> dict[str, tuple[Any, Any]]:
    """Fields of `obj` that differ from the default, as name -> (value, default); the default of a
    field megatron-core defines is megatron-core's. Values finalize derived are left out."""
    derived = obj.derived_fields() if isinstance(obj, ConfigBase) else frozenset()
    diff = {}
    for spec in specs(type(obj)).values():
        default = spec.core_default
        if default is NO_DEFAULT:
            continue
        value = getattr(obj, spec.name, default)
        if spec.name not in derived and not values_equal(value, default):
            diff[spec.name] = (value, default)
    return diff
