"""The state of a training run: counters that checkpoints save, and the objects a step needs."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.timers import Timers
    from megatron.core.transformer.module import MegatronModule

    from megatron_bridge.data.phases import PhaseAnnouncer
    from megatron_bridge.training.config import ConfigContainer
    from megatron_bridge.training.loggers.base import Tracker
    from megatron_bridge.training.progress import ProgressFile
    from megatron_bridge.training.resiliency.fault_tolerance import FaultTolerance
    from megatron_bridge.training.resiliency.stragglers import StragglerMonitor
    from megatron_bridge.training.signals import ExitSignalHandler
    from megatron_bridge.runtime.tokenizers.tokenizer import HuggingFaceTokenizer, NullTokenizer


@dataclass
class TrainState:
    """Counters of a run; saved with every checkpoint and restored on resume."""

    step: int = 0
    """Optimizer steps taken (the iteration number)."""

    consumed_train_samples: int = 0
    """Training samples drawn so far (the dataloader resumes here)."""

    skipped_train_samples: int = 0
    """Samples of iterations whose optimizer step was skipped (e.g. fp16 overflow)."""

    consumed_valid_samples: int = 0
    """Validation samples drawn so far."""

    floating_point_operations_so_far: float = 0.0
    """Model FLOPs of all steps so far."""

    do_train: bool = False
    do_valid: bool = False
    do_test: bool = False

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)


@dataclass
class GlobalState:
    """Everything a running job shares: the resolved config, counters, timers, tokenizer, tracker.

    `forward_step` functions that take a `state` argument receive this object.
    """

    cfg: "ConfigContainer"
    train_state: TrainState = field(default_factory=TrainState)
    timers: Optional["Timers"] = None
    tokenizer: Union["NullTokenizer", "HuggingFaceTokenizer", None] = None
    tracker: Optional["Tracker"] = None
    signal_handler: Optional["ExitSignalHandler"] = None
    start_time: float = field(default_factory=time.time)
    device: str = "cpu"
    rank: int = 0
    world_size: int = 1
    logging_rank: int = 0
    """Rank that prints and writes to trackers: the last rank (it holds the last pipeline stage)."""

    created_process_group: bool = False
    """True if `pretrain()` created the process group (and so must destroy it)."""

    cpu_backend_activated: bool = False
    deterministic_before: Optional[tuple[bool, bool]] = None
    """torch's deterministic-algorithms setting (on, warn only) before `model.deterministic_mode`
    turned it on; put back when the run ends, so a later run in the process is not affected."""
    tp_communicators: bool = False
    """True while TransformerEngine's userbuffers for tensor-parallel overlap exist."""

    model: Optional[list["MegatronModule"]] = None
    """The model chunks of this rank (megatron DDP-wrapped), once built. The only reference the
    run keeps: the loop, checkpoints and forward steps read it here."""

    optimizer: Optional["MegatronOptimizer"] = None
    """The megatron-core optimizer, once built."""

    scheduler: Optional["OptimizerParamScheduler"] = None
    """The `OptimizerParamScheduler`, once built."""

    progress: Optional["ProgressFile"] = None
    """The `progress.txt` writer (`logger.log_progress`, logging rank only)."""

    fault_tolerance: Optional["FaultTolerance"] = None
    """Progress reports to nvidia-resiliency-ext's ft_launcher (when `ft.enable_ft_package`)."""

    stragglers: Optional["StragglerMonitor"] = None
    """Straggler detection (when `straggler.log_straggler` or `nvrx_straggler.enabled`)."""

    save_lock: Optional[str] = None
    """Path of the save directory's lock while this job holds it (rank 0)."""
    data_phases: Optional["PhaseAnnouncer"] = None
    """The blend-phase schedule (`dataset.blend_phases`): `label(iteration)` names the active phase."""

    exit_code: int = 0
    """Non-zero when the job must end with this status (the rerun state machine asks for a restart)."""

    unchecked_losses: Optional[list] = None
    """While a training step or an evaluation batch runs its micro batches: their losses (on the
    device), checked for NaN/Inf together once the passes end (`gpt_step.check_step_losses`);
    None elsewhere, where each loss is checked as it is computed."""

    batch_lengths: Optional[Counter] = None
    """While a training step runs its micro batches: {sequence length: sequences} of the batches
    `gpt_step.get_batch` handed out (before context-parallel slicing), so throughput counts the
    tokens of batches padded only to their longest sample; None elsewhere."""

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == self.logging_rank
