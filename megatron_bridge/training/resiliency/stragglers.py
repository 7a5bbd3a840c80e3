"""Straggler detection on GPUs: megatron-core's detector (`straggler.log_straggler`) and
nvidia-resiliency-ext's (`nvrx_straggler.enabled`).

Both time work with CUDA events or CUPTI, so they need GPUs; on CPU the configuration is refused
before the run starts (see `cpu_backend.adapt_config`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from megatron_bridge.extras import require
from megatron_bridge.runtime.callbacks import Callback
from megatron_bridge.models.param_count import flops_per_token

if TYPE_CHECKING:
    from megatron_bridge.training.state import GlobalState

logger = logging.getLogger("megatron_bridge")


class StragglerDetected(RuntimeError):
    """`nvrx_straggler.stop_if_detected` and a straggler was found."""


class StragglerMonitor(Callback):
    """Times each step with the configured detectors and reports at the configured intervals."""

    def __init__(self, state: "GlobalState"):
        cfg = state.cfg
        self.state = state
        self.mcore: Optional[Any] = None
        self.nvrx: Optional[Any] = None
        self.section: Optional[Any] = None
        if cfg.straggler is not None and cfg.straggler.log_straggler:
            from megatron.core.utils import __straggler__ as detector

            detector.configure(
                state.world_size,
                state.rank,
                mmcnt=cfg.straggler.straggler_minmax_count,
                port=cfg.straggler.straggler_ctrlr_port,
                enabled=cfg.straggler.enable_straggler_on_startup,
            )
            self.mcore = detector
        n = cfg.nvrx_straggler
        if n is not None and n.enabled:
            straggler = require("nvidia_resiliency_ext.straggler", "nvrx_straggler.enabled")
            scores = [s for s, on in (("relative_perf_scores", n.calc_relative_gpu_perf), ("individual_perf_scores", n.calc_individual_gpu_perf)) if on]
            straggler.Detector.initialize(
                scores_to_compute=scores or "all",
                gather_on_rank0=True,
                profiling_interval=n.profiling_interval,
                report_time_interval=n.report_time_interval,
            )
            self.nvrx = straggler.Detector
            self.log = logging.getLogger(n.logger_name)

    def on_step_start(self, state: "GlobalState") -> None:
        if self.mcore is not None:
            self.mcore.start()
        if self.nvrx is not None:
            self.section = self.nvrx.detection_section("train_step", profile_cuda=True)
            self.section.__enter__()

    def on_step_end(self, state: "GlobalState", metrics: dict) -> None:
        if self.nvrx is not None and self.section is not None:
            self.section.__exit__(None, None, None)
            self.section = None
            self._nvrx_report()
        if self.mcore is not None:
            self.mcore.stop()
            interval = state.cfg.logger.log_interval
            if state.train_state.step % interval == 0:
                m = state.cfg.model
                flops = flops_per_token(m) * state.cfg.train.global_batch_size * m.seq_length * interval
                self.mcore.report(flops, interval)

    def _nvrx_report(self) -> None:
        n = self.state.cfg.nvrx_straggler
        report = self.nvrx.generate_report_if_interval_elapsed()
        if report is None:  # gathered on rank 0 only, once per report_time_interval
            return
        stragglers = report.identify_stragglers(
            gpu_rel_threshold=n.gpu_relative_perf_threshold, gpu_indiv_threshold=n.gpu_individual_perf_threshold
        )
        if n.enable_logging:
            self.log.info("GPU performance scores: %s", _best_and_worst(report, n.num_gpu_perf_scores_to_print))
        found = any(stragglers.get(kind) for kind in ("straggler_gpus_relative", "straggler_gpus_individual"))
        if found:
            self.log.warning("stragglers detected: %s", stragglers)
            if n.stop_if_detected:
                raise StragglerDetected(f"stragglers detected: {stragglers} (nvrx_straggler.stop_if_detected is set)")

    def close(self) -> None:
        if self.nvrx is not None:
            self.nvrx.shutdown()


def _best_and_worst(report: Any, count: int) -> str:
    scores = getattr(report, "gpu_relative_perf_scores", {}) or {}
    ranked = sorted(scores.items(), key=lambda kv: kv[1])
    if count <= 0 or not ranked:
        return "-"
    return f"worst {ranked[:count]} best {ranked[-count:]}"
