"""Every config class of a training run, `runtime_config_update`, and `ConfigValidationError`.

Each section lives in its own module here; this package gathers them under one import path.
"""

from megatron_bridge.training.config.checkpoint import CheckpointConfig
from megatron_bridge.training.config.container import ConfigContainer
from megatron_bridge.data.config import (
    DataloaderConfig,
    DatasetBuildContext,
    DatasetProvider,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    GPTFIMDatasetConfig,
    MockGPTDatasetConfig,
    PackedSequenceSpecs,
)
from megatron_bridge.training.config.distributed import DistributedDataParallelConfig, DistributedInitConfig, RNGConfig
from megatron_bridge.config.errors import ConfigValidationError, MissingPackageError
from megatron_bridge.training.config.logger import LoggerConfig
from megatron_bridge.training.config.loop import TrainingConfig, ValidationConfig
from megatron_bridge.training.config.optimizer import (
    OptimizerConfig,
    OptimizerConfigOverrideProvider,
    OptimizerConfigOverrideProviderContext,
)
from megatron_bridge.training.config.profiling import ProfilingConfig, TensorInspectConfig
from megatron_bridge.training.config.resiliency import (
    FaultToleranceConfig,
    InProcessRestartConfig,
    NVRxStragglerDetectionConfig,
    RerunStateMachineConfig,
    StragglerDetectionConfig,
)
from megatron_bridge.training.config.runtime import runtime_config_update
from megatron_bridge.training.config.scheduler import SchedulerConfig

__all__ = [
    "CheckpointConfig",
    "ConfigContainer",
    "ConfigValidationError",
    "DataloaderConfig",
    "DatasetBuildContext",
    "DatasetProvider",
    "DistributedDataParallelConfig",
    "DistributedInitConfig",
    "FaultToleranceConfig",
    "FinetuningDatasetConfig",
    "GPTDatasetConfig",
    "GPTFIMDatasetConfig",
    "InProcessRestartConfig",
    "LoggerConfig",
    "MissingPackageError",
    "MockGPTDatasetConfig",
    "NVRxStragglerDetectionConfig",
    "OptimizerConfig",
    "OptimizerConfigOverrideProvider",
    "OptimizerConfigOverrideProviderContext",
    "PackedSequenceSpecs",
    "ProfilingConfig",
    "RNGConfig",
    "RerunStateMachineConfig",
    "SchedulerConfig",
    "StragglerDetectionConfig",
    "TensorInspectConfig",
    "TrainingConfig",
    "ValidationConfig",
    "runtime_config_update",
]
