"""`logger.log_progress`: a `progress.txt` beside the checkpoints with one line per job start,
saved checkpoint and job end.

A long run is many jobs (preemptions, restarts, time limits). The file survives all of them and
answers, without a tracker: when did each job start and stop, how far did it get, and at what
throughput in model TFLOP/s per device. Lines are tab-separated `key: value` fields, appended
(by the logging rank only) and flushed at once so a killed job leaves its last line behind.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from megatron_bridge.training.state import GlobalState

FILE_NAME = "progress.txt"


def job_id() -> str:
    """The scheduler's job id where there is one, else this process's id."""
    for name in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(name):
            return os.environ[name]
    return f"pid-{os.getpid()}"


class ProgressFile:
    """Appends progress lines for one job to `<directory>/progress.txt`."""

    def __init__(self, directory: str, state: "GlobalState"):
        self.path = os.path.join(directory, FILE_NAME)
        self.state = state
        self.job = job_id()
        # created after the checkpoint is loaded: FLOPs from here on are this job's
        self.start_time = time.time()
        self.start_flops = state.train_state.floating_point_operations_so_far

    @classmethod
    def for_run(cls, state: "GlobalState") -> Optional["ProgressFile"]:
        """A progress file on the logging rank when `logger.log_progress` is set, else None."""
        cfg = state.cfg
        if not cfg.logger.log_progress or not cfg.checkpoint.save or not state.is_logging_rank:
            return None
        os.makedirs(cfg.checkpoint.save, exist_ok=True)
        return cls(cfg.checkpoint.save, state)

    def started(self) -> None:
        self.write("Starting job")

    def checkpoint_saved(self, iteration: int) -> None:
        self.write("Saved checkpoint", iteration)

    def finished(self, reason: str) -> None:
        self.write(f"Job finished ({reason})")

    def failed(self, error: BaseException) -> None:
        self.write(f"Job failed ({type(error).__name__})")

    def write(self, event: str, iteration: Optional[int] = None) -> None:
        ts, cfg = self.state.train_state, self.state.cfg
        elapsed = time.time() - self.start_time
        job_flops = ts.floating_point_operations_so_far - self.start_flops
        tflops = job_flops / elapsed / max(1, self.state.world_size) / 1e12 if elapsed > 0 else 0.0
        fields = [
            time.strftime("%Y-%m-%d %H:%M:%S"),
            f"job: {self.job}",
            f"devices: {self.state.world_size}",
            event,
            f"iteration: {ts.step if iteration is None else iteration}",
            f"samples: {ts.consumed_train_samples}",
            f"tokens: {ts.consumed_train_samples * cfg.model.seq_length}",
            f"model FLOPs: {ts.floating_point_operations_so_far:.3e}",
            f"job throughput: {tflops:.4g} TFLOP/s/device",
        ]
        with open(self.path, "a") as f:
            f.write("\t".join(fields) + "\n")
