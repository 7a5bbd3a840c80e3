"""Result validation, fault tolerance, in-process restart and straggler detection."""

from __future__ import annotations

from typing import Literal, Optional

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import COUNT, INTERVAL, POSITIVE, PROBABILITY, SECONDS, SIZE, STEPS, field


@config_dataclass(kw_only=True)
class RerunStateMachineConfig(ConfigBase):
    """Configuration for the rerun state machine used for result validation or stats."""

    rerun_mode: Literal["disabled", "validate_results", "report_determinism_stats"] = "disabled"
    """Use re-run engine to validate results (default) or to emit stats on variability of
    computations due to non-deterministic algorithms."""

    check_for_nan_in_loss: bool = True
    """Stop with an error naming the iteration and rank when the loss is NaN or Inf."""

    check_for_spiky_loss: bool = False
    """Report a loss far above the recent maximum (see spiky_loss_factor)."""

    spiky_loss_factor: float = field(10.0, range="(1, inf)")
    """A loss above this multiple of the maximum loss over the recent window is spiky."""

    error_injection_rate: int = field(0, range=COUNT)
    """Inject a fault into one in N validated results (0: never); for testing the machinery."""

    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = "transient_error"
    """Kind of injected fault."""


@config_dataclass(kw_only=True)
class FaultToleranceConfig(ConfigBase):
    """Configuration settings related to fault tolerance mechanisms (nvidia-resiliency-ext)."""

    enable_ft_package: bool = False
    """Report heartbeats and sections to nvidia-resiliency-ext's ft_launcher, which restarts hung
    or crashed ranks."""

    calc_ft_timeouts: bool = False
    """Compute section timeouts from observed durations and store them with checkpoints."""

    simulate_fault: bool = False
    """Inject a simulated fault (for testing fault tolerance)."""

    simulated_fault_type: Literal["rank_hung", "rank_killed", "random"] = "random"
    """How the simulated fault should behave. 'random' will randomly choose one of the other two."""

    simulated_fault_rank: Optional[int] = field(None, range=STEPS)
    """Rank on which simulated fault should occur (default: a random rank)."""

    simulated_fault_base_delay: int = field(0, range="[0, 31536000]")
    """Base delay before simulated fault thread is started. A small random delay is added to this."""

    def _finalize(self, problems: Problems) -> None:
        if self.enable_ft_package:
            problems.require_package("nvidia_resiliency_ext", "enable_ft_package", "fault tolerance")


@config_dataclass(kw_only=True)
class StragglerDetectionConfig(ConfigBase):
    """Configuration settings for detecting and logging GPU stragglers (megatron-core detector)."""

    log_straggler: bool = False
    """Measure per-rank GPU throughput and log the slowest and fastest ranks."""

    enable_straggler_on_startup: bool = True
    """If set, StragglerDetector is enabled on startup."""

    straggler_ctrlr_port: int = field(65535, range="[1, 65535]")
    """Port of the detector's control server (toggle it at run time)."""

    straggler_minmax_count: int = field(1, range=SIZE)
    """How many slowest/fastest ranks to report."""


@config_dataclass(kw_only=True)
class NVRxStragglerDetectionConfig(ConfigBase):
    """Configuration settings for NVIDIA Resiliency Extension straggler detection."""

    enabled: bool = False
    """Enable NVRx straggler detection."""

    report_time_interval: float = field(300.0, range=POSITIVE)
    """Interval [seconds] of the straggler check."""

    calc_relative_gpu_perf: bool = True
    """Calculate relative GPU performance scores."""

    calc_individual_gpu_perf: bool = True
    """Calculate individual GPU performance scores."""

    num_gpu_perf_scores_to_print: int = field(5, range=COUNT)
    """Best and worst performance scores to print periodically (0: only when stragglers are detected)."""

    gpu_relative_perf_threshold: float = field(0.7, range=PROBABILITY)
    """Threshold for relative GPU performance scores."""

    gpu_individual_perf_threshold: float = field(0.7, range=PROBABILITY)
    """Threshold for individual GPU performance scores."""

    stop_if_detected: bool = False
    """Set to True, to terminate the workload if stragglers are detected."""

    enable_logging: bool = True
    """Set to True, to log GPU performance scores."""

    profiling_interval: int = field(1, range=INTERVAL)
    """Profiling interval passed to straggler.Detector.initialize."""

    logger_name: str = "megatron_bridge.NVRxStragglerDetection"
    """Logger name for straggler detection messages."""

    def _finalize(self, problems: Problems) -> None:
        if self.enabled:
            problems.require_package("nvidia_resiliency_ext", "enabled", "NVRx straggler detection")
            problems.check(
                self.calc_relative_gpu_perf or self.calc_individual_gpu_perf,
                "calc_relative_gpu_perf",
                "calc_relative_gpu_perf and calc_individual_gpu_perf are both False: the detector would compute "
                "no score and so never find a straggler",
                "set nvrx_straggler.calc_relative_gpu_perf=True (or calc_individual_gpu_perf=True), or enabled=False",
            )


@config_dataclass(kw_only=True)
class InProcessRestartConfig(ConfigBase):
    """Configuration settings for NVIDIA Resiliency Extension in-process restart functionality."""

    enabled: bool = False
    """Enable in-process restart mechanism from nvidia-resiliency-ext."""

    max_iterations: Optional[int] = field(None, range=INTERVAL)
    """Maximum number of in-process restart iterations."""

    monitor_thread_interval: float = field(1.0, range=SECONDS)
    """Monitoring interval (in seconds) for the monitoring thread."""

    monitor_process_interval: float = field(1.0, range=SECONDS)
    """Monitoring interval (in seconds) for the monitoring process."""

    progress_watchdog_interval: float = field(1.0, range=SECONDS)
    """Interval (in seconds) for automatic progress watchdog timestamp updates."""

    heartbeat_interval: float = field(30.0, range=SECONDS)
    """Monitoring interval (in seconds) for detecting unresponsive ranks."""

    soft_timeout: float = field(60.0, range=SECONDS)
    """Soft progress timeout (in seconds)."""

    hard_timeout: float = field(90.0, range=SECONDS)
    """Hard progress timeout (in seconds)."""

    heartbeat_timeout: float = field(60.0, range=SECONDS)
    """Timeout (in seconds) for a missing rank detection heartbeat."""

    barrier_timeout: float = field(120.0, range=SECONDS)
    """Timeout (in seconds) for internal distributed barrier."""

    completion_timeout: float = field(120.0, range=SECONDS)
    """Timeout (in seconds) for barrier on completion on all ranks."""

    last_call_wait: float = field(1.0, range=SECONDS)
    """Time interval (in seconds) for other ranks to report concurrent terminal failures."""

    termination_grace_time: float = field(1.0, range=SECONDS)
    """Interval (in seconds) between SIGTERM and SIGKILL issued on hard timeout."""

    granularity: Literal["node", "rank"] = "node"
    """Granularity for in-process restart."""

    active_world_size: Optional[int] = field(None, range=SIZE)
    """Ranks that run the workload at first; the rest of the allocation is a warm reserve (None: WORLD_SIZE)."""

    empty_cuda_cache: bool = True
    """Empty CUDA cache during restart finalization."""

    max_rank_faults: Optional[int] = field(None, range=STEPS)
    """Maximum number of rank faults allowed before terminating the job."""

    monitor_process_logdir: Optional[str] = None
    """Directory for monitor process log files. If None, monitor process logging is disabled."""

    def _finalize(self, problems: Problems) -> None:
        if not self.enabled:
            return
        problems.require_package("nvidia_resiliency_ext", "enabled", "in-process restart")
        # the orderings nvidia-resiliency-ext requires of its intervals and timeouts
        for shorter, longer in (
            ("soft_timeout", "hard_timeout"),
            ("hard_timeout", "barrier_timeout"),
            ("heartbeat_timeout", "barrier_timeout"),
            ("heartbeat_interval", "heartbeat_timeout"),
            ("monitor_process_interval", "heartbeat_timeout"),
            ("monitor_process_interval", "soft_timeout"),
            ("monitor_thread_interval", "soft_timeout"),
            ("progress_watchdog_interval", "soft_timeout"),
        ):
            a, b = getattr(self, shorter), getattr(self, longer)
            problems.check(
                a < b,
                shorter,
                f"{shorter} ({a}) must be shorter than {longer} ({b})",
                f"lower inprocess_restart.{shorter} or raise inprocess_restart.{longer}",
            )
