"""Process groups, data-parallel wrapping and random seeds."""

from __future__ import annotations

from typing import Literal, Optional, Tuple

from megatron.core.distributed import DistributedDataParallelConfig as MCoreDistributedDataParallelConfig

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import SEED, SIZE, STEPS, Unsupported, field


@config_dataclass(kw_only=True)
class DistributedInitConfig(ConfigBase):
    """Configuration settings for distributed training initialization."""

    distributed_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: `nccl` (GPUs), `gloo` (CPUs), or `auto` (nccl when CUDA is available,
    else gloo). The backend decides the device: nccl trains on GPUs, one per process; gloo trains
    on CPUs, also on a machine with GPUs."""

    distributed_timeout_minutes: int = field(10, range=SIZE)
    """Timeout for collectives; a rank that waits longer fails instead of hanging."""

    distributed_timeout_seconds_after_init: Optional[int] = field(
        None,
        range=SIZE,
        status=Unsupported('not implemented: use distributed_timeout_minutes'),
    )
    """A shorter collective timeout to switch to once initialization is done."""

    align_grad_reduce: bool = True
    """Launch gradient reduction at the same time on all pipeline stages."""

    local_rank: Optional[int] = field(None, range=STEPS)
    """Local rank on the node (default: the LOCAL_RANK environment variable, else 0)."""

    lazy_mpu_init: bool = field(
        False,
        status=Unsupported('not implemented: process groups are always created at setup'),
    )
    """Set up model-parallel state without initializing torch.distributed (external launchers)."""

    use_torch_fsdp2: bool = field(
        False,
        status=Unsupported(
            "not implemented: models are wrapped with megatron DDP; use ddp.use_distributed_optimizer=True"
        ),
    )
    """Wrap the model with PyTorch FSDP2 instead of megatron DDP."""

    nccl_communicator_config_path: Optional[str] = None
    """YAML file with per-group NCCL communicator settings."""

    use_tp_pp_dp_mapping: bool = False
    """Order ranks TP-PP-DP instead of TP-DP-PP."""

    use_gloo_process_groups: bool = True
    """Also create gloo groups next to the NCCL ones (used by checkpointing)."""

    use_sharp: bool = False
    """Use SHARP in-network reductions for data-parallel groups."""

    high_priority_stream_groups: Optional[list[str]] = None
    """Process groups that get high-priority CUDA streams."""

    disable_jit_fuser: bool = field(False, status=Unsupported('not implemented'))
    """Turn off the TorchScript/nvFuser JIT fuser."""

    external_gpu_device_mapping: bool = False
    """GPUs are mapped to processes outside (e.g. CUDA_VISIBLE_DEVICES): use device 0, not the local rank."""

    enable_megatron_core_experimental: bool = field(False, status=Unsupported('not implemented'))
    """Enable experimental features for Megatron Core."""

    use_decentralized_pg: bool = field(
        False,
        status=Unsupported("not implemented: megatron-core's global process groups are used"),
    )
    """Pass process groups through functions instead of megatron-core's global parallel state."""

    recipe_world_size: Optional[int] = field(None, range=SIZE)
    """Processes (GPUs) the config is laid out for, recorded by its recipe; dry runs and plans use
    it when no world size is given."""

    _field_aliases = {"lazy_init": "lazy_mpu_init"}


@config_dataclass(kw_only=True)
class RNGConfig(ConfigBase):
    """Random seeds."""

    seed: int = field(1234, range=SEED)
    """Seed for Python, NumPy and torch; model-parallel ranks derive their own streams from it."""

    te_rng_tracker: bool = False
    """Use TransformerEngine's RNG tracker (needed for CUDA graphs)."""

    inference_rng_tracker: bool = False
    """Use the RNG tracker meant for inference."""

    data_parallel_random_init: bool = False
    """Initialize data-parallel replicas with different weights (normally they start identical)."""


@config_dataclass(kw_only=True)
class DistributedDataParallelConfig(MCoreDistributedDataParallelConfig, ConfigBase):
    """Megatron Core DistributedDataParallelConfig with deferred post-init.

    Construction stores values only; `finalize()` runs megatron-core's checks and derived values.
    """

    param_name_patterns_for_fp32_local_accumulation: Tuple[str, ...] = field(
        (),
        status=Unsupported('not implemented: megatron-core 0.16.1 has no such option'),
    )
    """fnmatch patterns selecting parameters whose gradients should be locally accumulated in
    FP32. The special pattern 'all' matches every parameter."""

    def __post_init__(self) -> None:
        """Skip megatron-core's post-init; `finalize()` runs it."""

    def _finalize(self, problems: Problems) -> None:
        problems.check(
            not self.reuse_grad_buf_for_mxfp8_param_ag or self.fp8_param_gather,
            "reuse_grad_buf_for_mxfp8_param_ag",
            "reusing the grad buffer for the param all-gather needs fp8_param_gather",
            "set ddp.fp8_param_gather=True or turn reuse_grad_buf_for_mxfp8_param_ag off",
        )
        problems.check(
            not self.overlap_param_gather or self.use_distributed_optimizer,
            "overlap_param_gather",
            "True overlaps the distributed optimizer's parameter all-gather, and the distributed optimizer is off "
            "(megatron-core ignores it then)",
            "set ddp.use_distributed_optimizer=True, or turn overlap_param_gather off",
        )
        self._run_parent_post_init(MCoreDistributedDataParallelConfig, problems)
