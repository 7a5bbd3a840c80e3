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
from megatron_bridge.training.config.runtime import (
    current_world_size,
    data_parallel_size_for,
    derive_data_parallel_size,
    validate_into,
)

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

    data_parallel_size: Optional[int] = field(init=False, default=None, range=SIZE)
    """Derived: world size // (TP x PP x CP), set by runtime_config_update."""

    _moved_fields = {"recipe_world_size": "dist.recipe_world_size"}

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Run the validation rules (`mbridge config rules`): finalize every section, derive values,
        check across sections; raise one `ConfigValidationError` listing every problem found."""
        problems = Problems()
        validate_into(self, problems)
        problems.raise_if_any()

    def get_data_parallel_size(self, world_size: int) -> int:
        """world_size // (TP x PP x CP) of this config's model; `ConfigValidationError` if it does
        not divide."""
        problems = Problems()
        dp = data_parallel_size_for(self.model, world_size, problems)
        problems.raise_if_any()
        return dp

    def set_data_parallel_size(self) -> None:
        """Set `data_parallel_size` (here and on `comm_overlap`) for the current world size (the
        process group's, else WORLD_SIZE, else 1) without finalizing or validating anything else."""
        problems = Problems()
        derive_data_parallel_size(self, problems, current_world_size())
        problems.raise_if_any()

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
            derived = section.derived_fields() if isinstance(section, ConfigBase) else frozenset()
            diff = {}
            for spec in specs(type(section)).values():
                default = spec.core_default
                value = getattr(section, spec.name, default)
                if default is not NO_DEFAULT and spec.name not in derived and not values_equal(value, default):
                    diff[spec.name] = (value, default)
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

