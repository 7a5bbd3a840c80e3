"""What to log, how often, and to which experiment trackers."""

from __future__ import annotations

from typing import Literal, Optional

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import INTERVAL, POSITIVE, SIZE, Unsupported, field
from megatron_bridge.config.secrets import REDACTED


@config_dataclass(kw_only=True)
class LoggerConfig(ConfigBase):
    """Configuration settings for logging: console, TensorBoard, W&B, MLflow and Comet."""

    log_interval: int = field(100, range=INTERVAL)
    """Log training metrics every N iterations."""

    log_params_norm: bool = False
    """Log `params-norm`, the L2 norm of all parameters (an extra pass over the weights and a
    reduction over the model-parallel ranks at each log step)."""

    log_throughput: bool = False
    """Log TFLOP/s per device and model FLOPs utilization."""

    log_progress: bool = False
    """Append a line to `<checkpoint.save>/progress.txt` at each job start, saved checkpoint and
    job end: iteration, samples, tokens, model FLOPs and the job's TFLOP/s per device."""

    timing_log_level: Literal[-1, 0, 1, 2] = 0
    """Granularity of timers: -1 none; 0 iteration time only (no overhead); 1 also operations run
    about once per iteration (optimizer, gradient all-reduce); 2 also operations run many times per
    iteration (forward/backward per microbatch). Levels 1 and 2 may slow iterations down."""

    timing_log_option: Literal["max", "minmax", "all"] = field(
        "minmax",
        status=Unsupported(
            "not implemented: timers are reported as their maximum over ranks (`<name>-time`); megatron-core's timer "
            "report, which this option formats, is not produced"
        ),
    )
    """How timers are reduced across ranks."""

    tensorboard_dir: Optional[str] = None
    """Write TensorBoard event files here (None: no TensorBoard)."""

    tensorboard_log_interval: int = field(1, range=INTERVAL)
    """Write to TensorBoard every N logged iterations (every N x log_interval iterations), each
    record the averages of its log interval, as on the console. NVIDIA Megatron Bridge instead
    writes every N iterations whatever log_interval is: set log_interval=1 for every iteration."""

    tensorboard_queue_size: int = field(1000, range=SIZE)
    """Events queued before TensorBoard flushes to disk."""

    log_timers_to_tensorboard: bool = False
    """Send timer values to the trackers."""

    log_loss_scale_to_tensorboard: bool = True
    """Send the loss scale to the trackers."""

    log_validation_ppl_to_tensorboard: bool = False
    """Send validation perplexity to the trackers."""

    log_memory_to_tensorboard: bool = False
    """Send memory usage to the trackers."""

    log_world_size_to_tensorboard: bool = False
    """Send the world size to the trackers."""

    wandb_project: Optional[str] = None
    """Weights & Biases project (None: no W&B)."""

    wandb_exp_name: Optional[str] = None
    """Weights & Biases run name."""

    wandb_save_dir: Optional[str] = None
    """Local directory for W&B files."""

    wandb_entity: Optional[str] = None
    """Weights & Biases team or user."""

    mlflow_experiment: Optional[str] = None
    """The MLFlow experiment name (None: no MLflow)."""

    mlflow_run_name: Optional[str] = None
    """The MLFlow run name."""

    mlflow_tracking_uri: Optional[str] = None
    """Optional MLFlow tracking URI."""

    mlflow_tags: Optional[dict[str, str]] = None
    """Optional tags to apply to the MLFlow run."""

    mlflow_log_checkpoints: bool = False
    """When the run ends (also when it fails), copy the checkpoint directory (`checkpoint.save`) into
    the MLflow run's artifacts under `checkpoints/`. Off by default: it doubles the disk space the
    checkpoints take where the artifact store is local."""

    comet_project: Optional[str] = None
    """The Comet ML project name. Comet logging is disabled when this is None."""

    comet_experiment_name: Optional[str] = None
    """The Comet ML experiment name."""

    comet_workspace: Optional[str] = None
    """The Comet ML workspace. If not set, uses the default workspace for the API key."""

    comet_api_key: Optional[str] = None
    """The Comet ML API key; also read from the COMET_API_KEY environment variable. Written
    configs hold `<redacted>` in its place, or `${oc.env:VAR}` where it was given that way."""

    comet_tags: Optional[list[str]] = None
    """Optional list of tags to apply to the Comet ML experiment."""

    comet_offline_directory: Optional[str] = None
    """Write Comet experiments to this directory instead of the Comet servers."""

    tracker_subprocess: bool = True
    """Run the experiment trackers (TensorBoard, W&B, MLflow, Comet) in a helper process: the
    training process only hands each log step's metrics over a pipe, so the trackers' encoding,
    file and database writes do not slow training. False runs them in the training process."""

    peak_tflops_per_device: Optional[float] = field(None, range=POSITIVE)
    """Peak dense TFLOP/s of one device for model-FLOPs-utilization (default: looked up from the
    GPU name for known GPUs)."""

    logging_level: Optional[int] = field(None, range="[0, 50]")
    """Set default logging level."""

    filter_warnings: bool = True
    """Silence known noisy warnings from dependencies."""

    modules_to_filter: Optional[list[str]] = None
    """Logger names whose records are dropped."""

    set_level_for_all_loggers: bool = False
    """Apply logging_level to every logger, not just this package's."""

    log_energy: bool = False
    """Log `energy-joules` (since training started) and `power-watts`, summed over all GPUs,
    from NVML's counters (the `nvml` extra; GPU only)."""

    save_config_filepath: Optional[str] = None
    """Write the resolved config as YAML to this file at start-up."""

    skip_train_metrics_log: bool = False
    """Skips logging of training metrics to all logging backends and to the console as well."""

    def _finalize(self, problems: Problems) -> None:
        for name, run_name, module, what in (
            ("tensorboard_dir", None, "tensorboard", "TensorBoard logging"),
            ("wandb_project", None, "wandb", "W&B logging"),
            ("mlflow_experiment", "mlflow_run_name", "mlflow", "MLflow logging"),
            ("comet_project", "comet_experiment_name", "comet_ml", "Comet logging"),
        ):
            value = getattr(self, name)
            if value is None:
                continue
            if run_name is not None:
                problems.check(
                    bool(getattr(self, run_name)),
                    run_name,
                    f"{name}={value!r} is set but {run_name} is not",
                    f"set logger.{run_name}",
                )
            problems.require_package(module, name, what)
        problems.check(
            self.comet_api_key != REDACTED,
            "comet_api_key",
            f"is {REDACTED!r}: the config was written without the credential",
            "give the key again, e.g. logger.comet_api_key=${oc.env:COMET_API_KEY}, or set COMET_API_KEY",
        )
