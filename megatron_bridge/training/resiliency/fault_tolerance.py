"""Fault tolerance with nvidia-resiliency-ext's `ft_launcher`: report progress so the launcher
restarts a crashed or hung rank, and simulated faults for testing that.

Progress is reported in sections when the launcher declares them
(`ft_launcher --ft-rank-section-timeouts=setup:600,step:180,checkpointing:420`): `setup` (start of
the job to the first step), `step` (each training step) and `checkpointing` (each save); time
outside them counts as "out of section". Otherwise each finished setup, step and save sends a
heartbeat. With `ft.calc_ft_timeouts`, timeouts are computed from observed durations and stored
with checkpoints, so a restarted job keeps them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

from megatron_bridge.extras import require
from megatron_bridge.runtime.callbacks import Callback
from megatron_bridge.runtime.launcher_env import launcher_int

if TYPE_CHECKING:
    from megatron_bridge.training.config import FaultToleranceConfig
    from megatron_bridge.training.state import GlobalState

logger = logging.getLogger("megatron_bridge")

SECTIONS = ("setup", "step", "checkpointing")


class FaultTolerance(Callback):
    """Section reports to the rank monitor of `ft_launcher` (one per rank)."""

    def __init__(self, config: "FaultToleranceConfig", rank: int):
        ft = require("nvidia_resiliency_ext.fault_tolerance", "ft.enable_ft_package")
        self.config = config
        self.rank = rank
        self.client = ft.RankMonitorClient()
        self.client.init_workload_monitoring()
        self._open: set[str] = set()
        declared = set(self.client.cfg.rank_section_timeouts or {})
        self.use_sections = set(SECTIONS) <= declared
        if not self.use_sections and rank == 0:
            logger.info(
                "fault tolerance: the launcher declares no timeouts for sections %s; sending heartbeats "
                "(ft_launcher --ft-rank-section-timeouts=setup:600,step:180,checkpointing:420 times sections)",
                list(SECTIONS),
            )
        self.start("setup")
        self.steps = 0

    # ------------------------------------------------------------------ sections
    def start(self, section: str) -> None:
        if section not in self._open:
            if self.use_sections:
                self.client.start_section(section)
            self._open.add(section)

    def end(self, section: str) -> None:
        if section in self._open:
            if self.use_sections:
                self.client.end_section(section)
            else:
                self.client.send_heartbeat()
            self._open.discard(section)
            if section == "checkpointing":
                # after a save, so its (long) duration is among the observations; the next
                # checkpoint stores the result
                self._calculate_timeouts()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.end(name)

    # ------------------------------------------------------------------ train-loop events
    def on_train_start(self, state: "GlobalState") -> None:
        self.end("setup")

    def on_step_start(self, state: "GlobalState") -> None:
        self.start("step")

    def on_step_end(self, state: "GlobalState", metrics: dict) -> None:
        self.end("step")
        self.steps += 1

    # ------------------------------------------------------------------ timeouts in checkpoints
    def _calculate_timeouts(self) -> None:
        if not self.config.calc_ft_timeouts:
            return
        if self.use_sections:
            self.client.calculate_and_set_section_timeouts(skip_if_not_ready=True)
        else:
            self.client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.client.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.client.load_state_dict(state)

    def close(self) -> None:
        for section in list(self._open):
            self.end(section)
        self._calculate_timeouts()
        self.client.shutdown_workload_monitoring()


def maybe_simulate_fault(config: "FaultToleranceConfig", rank: int, world_size: int) -> Optional[threading.Thread]:
    """Start the simulated fault `config` asks for, on its rank, after its delay.

    Faults fire only in a launcher's first attempt (TORCHELASTIC_RESTART_COUNT=0), so that a
    restarted job can run to completion.
    """
    if not config.simulate_fault or launcher_int("TORCHELASTIC_RESTART_COUNT", 0) > 0:
        return None
    target = config.simulated_fault_rank if config.simulated_fault_rank is not None else random.randrange(world_size)
    if rank != target:
        return None
    kind = config.simulated_fault_type
    if kind == "random":
        kind = random.choice(["rank_hung", "rank_killed"])
    delay = config.simulated_fault_base_delay + random.random()

    def fault() -> None:
        time.sleep(delay)
        logger.warning("simulated fault on rank %d after %.1f s: %s", rank, delay, kind)
        for handler in logging.getLogger().handlers + logging.getLogger("megatron_bridge").handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGSTOP if kind == "rank_hung" else signal.SIGKILL)

    thread = threading.Thread(target=fault, name="simulated-fault", daemon=True)
    thread.start()
    return thread
