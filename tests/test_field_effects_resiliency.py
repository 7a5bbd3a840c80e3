"""Effects of the fault-tolerance, simulated-fault, straggler and in-process restart settings.

The straggler detectors time GPU kernels (CUDA events, CUPTI), so their detector objects are
stand-ins that record what the run hands them; everything else here is the real thing: the
rank monitor server of nvidia-resiliency-ext, forked fault threads, nvidia-resiliency-ext's
straggler report and its in-process restart wrapper."""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import os
import signal
import time

import pytest
from factories import needs, one_process_group, tiny_config

from megatron_bridge.training.config import (
    FaultToleranceConfig,
    InProcessRestartConfig,
    NVRxStragglerDetectionConfig,
    StragglerDetectionConfig,
)
from megatron_bridge.training.state import GlobalState

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------- fault tolerance
@contextlib.contextmanager
def rank_monitor(tmp_path, monkeypatch):
    """nvidia-resiliency-ext's rank monitor server (ft_launcher starts one per rank), started in a
    fresh interpreter (a fork of this threaded process can crash in the child), timing the
    sections setup, step and checkpointing."""
    from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig as MonitorConfig
    from nvidia_resiliency_ext.fault_tolerance.data import FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_server import RankMonitorServer

    socket_path = str(tmp_path / "rank_monitor.socket")
    config = MonitorConfig(rank_section_timeouts={"setup": 600, "step": 180, "checkpointing": 420})
    server = RankMonitorServer.run_in_subprocess(config, socket_path, mp_ctx=multiprocessing.get_context("spawn"))
    monkeypatch.setenv(FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR, socket_path)
    try:
        yield
    finally:
        server.terminate()
        server.join(10)


def test_calc_ft_timeouts_stores_timeouts_computed_from_the_run(tmp_path, monkeypatch):
    """With `calc_ft_timeouts` the section timeouts are computed from the observed durations
    after a save and go into the fault-tolerance state that checkpoints store."""
    needs("nvidia_resiliency_ext")
    from megatron_bridge.training.resiliency.fault_tolerance import FaultTolerance

    def run_steps(config):
        with rank_monitor(tmp_path, monkeypatch):
            reports = FaultTolerance(config, rank=0)
            reports.on_train_start(None)
            for _ in range(2):
                reports.on_step_start(None)
                reports.on_step_end(None, {})
            with reports.section("checkpointing"):
                pass
            saved = reports.state_dict()
            reports.close()
        return saved["current_timeouts"]

    with one_process_group():  # the client agrees on timeouts with the other ranks
        default = run_steps(FaultToleranceConfig(enable_ft_package=True))
        computed = run_steps(FaultToleranceConfig(enable_ft_package=True, calc_ft_timeouts=True))
    assert default == {}
    assert computed["section"]["calculated_sections"] == ["checkpointing", "setup", "step"]
    assert all(0 < seconds < 60 for seconds in computed["section"]["section"].values())  # not the 180-600 s given


def fault_in_child(config, rank, world_size):
    """Fork; the child starts the simulated fault and waits for it. Returns how the child ended
    (or stopped)."""
    from megatron_bridge.training.resiliency.fault_tolerance import maybe_simulate_fault

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.environ.pop("TORCHELASTIC_RESTART_COUNT", None)
            started = maybe_simulate_fault(config, rank, world_size) is not None
            time.sleep(5 if started else 0)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, os.WUNTRACED)
    if os.WIFSTOPPED(status):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "stopped"
    return "killed" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL else "exited"


def test_simulated_faults_hang_or_kill_the_chosen_rank():
    fault = dict(simulate_fault=True, simulated_fault_rank=1)
    hung = FaultToleranceConfig(**fault, simulated_fault_type="rank_hung")
    killed = FaultToleranceConfig(**fault, simulated_fault_type="rank_killed")
    assert fault_in_child(hung, rank=1, world_size=2) == "stopped"  # SIGSTOP: a hung rank
    assert fault_in_child(killed, rank=1, world_size=2) == "killed"
    assert fault_in_child(killed, rank=0, world_size=2) == "exited"  # simulated_fault_rank is 1
    assert fault_in_child(FaultToleranceConfig(simulated_fault_rank=0), rank=0, world_size=1) == "exited"


# ---------------------------------------------------------------------- straggler detectors
class RecordingDetector:
    """Stands in for a GPU straggler detector: records calls; `report` is what it reports."""

    def __init__(self, report=None):
        self.calls = []
        self.report = report

    def configure(self, *args, **kwargs):
        self.calls.append(("configure", args, kwargs))

    def initialize(self, **kwargs):
        self.calls.append(("initialize", (), kwargs))

    def detection_section(self, name, profile_cuda):
        return contextlib.nullcontext()

    def generate_report_if_interval_elapsed(self):
        return self.report

    def shutdown(self):
        self.calls.append(("shutdown", (), {}))


def test_megatron_core_straggler_detector_gets_its_settings(monkeypatch):
    """megatron-core's detector times GPU work (on CPU it ignores its settings)."""
    import megatron.core.utils

    from megatron_bridge.training.resiliency.stragglers import StragglerMonitor

    detector = RecordingDetector()
    monkeypatch.setattr(megatron.core.utils, "__straggler__", detector)
    settings = StragglerDetectionConfig(
        log_straggler=True, enable_straggler_on_startup=False, straggler_ctrlr_port=12345, straggler_minmax_count=2
    )
    StragglerMonitor(GlobalState(cfg=tiny_config(straggler=settings), rank=1, world_size=4))
    assert detector.calls == [("configure", (4, 1), dict(mmcnt=2, port=12345, enabled=False))]


def nvrx_report(relative, individual):
    """A real nvidia-resiliency-ext report with the given per-rank GPU scores."""
    from nvidia_resiliency_ext.straggler import Report

    return Report(
        gpu_relative_perf_scores=relative, section_relative_perf_scores={},
        gpu_individual_perf_scores=individual, section_individual_perf_scores={},
        rank_to_node={rank: "node0" for rank in relative}, local_section_summaries={}, local_kernel_summaries={},
        generate_report_elapsed_time=0.0, gather_on_rank0=True, rank=0,
    )  # fmt: skip


def test_nvrx_straggler_settings(monkeypatch, caplog):
    """nvidia-resiliency-ext's detector profiles kernels with CUPTI (GPUs): a stand-in gives the
    report; the thresholds, logging and stopping act on the real report."""
    needs("nvidia_resiliency_ext")
    import nvidia_resiliency_ext.straggler as straggler

    from megatron_bridge.training.resiliency.stragglers import StragglerDetected, StragglerMonitor

    report = nvrx_report(relative={0: 1.0, 1: 0.9, 2: 0.8}, individual={0: 0.95, 1: 0.5, 2: 0.9})
    detector = RecordingDetector(report)
    monkeypatch.setattr(straggler, "Detector", detector)

    def monitor(**settings):
        cfg = tiny_config(nvrx_straggler=NVRxStragglerDetectionConfig(enabled=True, **settings))
        return StragglerMonitor(GlobalState(cfg=cfg, world_size=3))

    # Lenient individual threshold: rank 1 (0.5) is no straggler; the scores are logged, one best
    # and one worst, by the named logger.
    lenient = monitor(
        calc_relative_gpu_perf=False, profiling_interval=3, gpu_individual_perf_threshold=0.4,
        num_gpu_perf_scores_to_print=1, logger_name="my_job.stragglers",
    )  # fmt: skip
    assert detector.calls[-1][2]["scores_to_compute"] == ["individual_perf_scores"]
    assert detector.calls[-1][2]["profiling_interval"] == 3
    with caplog.at_level(logging.INFO, logger="my_job.stragglers"):
        lenient.on_step_start(lenient.state)
        lenient.on_step_end(lenient.state, {})
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("my_job.stragglers", "GPU performance scores: worst [(2, 0.8)] best [(0, 1.0)]")
    ]

    # Default threshold (0.7): rank 1 straggles, and stop_if_detected ends the run; with
    # enable_logging off the scores are not logged.
    caplog.clear()
    strict = monitor(calc_individual_gpu_perf=False, stop_if_detected=True, enable_logging=False)
    assert detector.calls[-1][2]["scores_to_compute"] == ["relative_perf_scores"]
    with caplog.at_level(logging.INFO), pytest.raises(StragglerDetected, match="rank=1"):
        strict.on_step_start(strict.state)
        strict.on_step_end(strict.state, {})
    messages = [r.getMessage() for r in caplog.records if r.name == "megatron_bridge.NVRxStragglerDetection"]
    assert len(messages) == 1 and messages[0].startswith("stragglers detected")


# ---------------------------------------------------------------------- in-process restart
def seconds(value):
    return datetime.timedelta(seconds=value)


def test_inprocess_restart_settings_reach_the_wrapper(tmp_path, monkeypatch):
    """The in-process restart run (tests/test_resiliency.py) is driven by this wrapper."""
    needs("nvidia_resiliency_ext")
    import torch

    from megatron_bridge.training.resiliency.inprocess import _launcher_environment, build_wrapper

    timing = dict(
        monitor_thread_interval=0.5, monitor_process_interval=0.6, progress_watchdog_interval=0.7,
        soft_timeout=20.0, hard_timeout=30.0, barrier_timeout=100.0, completion_timeout=50.0,
        last_call_wait=2.0, termination_grace_time=3.0,
    )  # fmt: skip
    settings = InProcessRestartConfig(
        enabled=True, max_iterations=4, max_rank_faults=2, granularity="rank", active_world_size=1,
        monitor_process_logdir=str(tmp_path), **timing,
    )  # fmt: skip
    with _launcher_environment():
        wrapper = build_wrapper(tiny_config(inprocess_restart=settings))
        default = build_wrapper(tiny_config(inprocess_restart=InProcessRestartConfig(enabled=True)))
    assert {name: getattr(wrapper, name) for name in timing} == {name: seconds(v) for name, v in timing.items()}
    assert wrapper.initialize.max_iterations == 4 and default.initialize.max_iterations is None
    (fault_counter,) = wrapper.health_check.instances
    assert fault_counter.max_rank_faults == 2
    # granularity 'rank': only the active-ranks layer (sized active_world_size); 'node' adds a
    # layer that restarts whole nodes.
    assert [(layer.min_ranks, layer.max_ranks) for layer in wrapper.rank_assignment.layers] == [(1, 1)]
    assert len(default.rank_assignment.layers) == 2
    assert wrapper.monitor_process_logfile == os.path.join(str(tmp_path), "monitor_{rank}.log")
    assert default.monitor_process_logfile is None

    # empty_cuda_cache: a finalizer empties the CUDA cache after a fault (on GPU machines, as
    # faked here; the health check it also adds only reads CUDA state when CUDA is initialized).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with _launcher_environment():
        emptying = build_wrapper(tiny_config(inprocess_restart=InProcessRestartConfig(enabled=True)))
        keeping = build_wrapper(tiny_config(inprocess_restart=InProcessRestartConfig(enabled=True, empty_cuda_cache=False)))
    assert [f.fn for f in emptying.finalize.instances] == [torch.cuda.empty_cache]
    assert keeping.finalize is None
