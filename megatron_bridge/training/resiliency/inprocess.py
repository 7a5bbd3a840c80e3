"""In-process restart with nvidia-resiliency-ext: a rank fault restarts training inside the same
processes, from the last checkpoint, instead of relaunching the job."""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import logging
import os
import socket
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

from megatron_bridge.extras import is_installed, require
from megatron_bridge.runtime.child_processes import children_may_outlive_parent, tie_children_to_parent
from megatron_bridge.runtime.distributed import free_port
from megatron_bridge.runtime.launcher_env import launcher_int

if TYPE_CHECKING:
    from megatron_bridge.runtime.callbacks import Callback
    from megatron_bridge.training.config import ConfigContainer
    from megatron_bridge.training.state import GlobalState

logger = logging.getLogger("megatron_bridge")


class ProcessGroupExistsError(RuntimeError):
    """In-process restart must create (and re-create) the process group itself."""


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def _launcher_environment():
    """A plain single process gets the variables a launcher would set, for the duration."""
    if "RANK" in os.environ:
        yield
        return

    saved = {name: os.environ.get(name) for name in _LAUNCHER_VARIABLES}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # the process-group store and the wrapper's store use the next two ports: all three must be free
    os.environ["MASTER_PORT"] = str(free_port(3))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def build_wrapper(config: "ConfigContainer") -> Any:
    """An `inprocess.Wrapper` with the timeouts, granularity and limits of `config.inprocess_restart`."""
    inprocess = require("nvidia_resiliency_ext.inprocess", "inprocess_restart.enabled")
    c = config.inprocess_restart
    world = launcher_int("WORLD_SIZE")
    active = c.active_world_size or world
    layers = [inprocess.rank_assignment.Layer(min_ranks=active, max_ranks=active, flag=inprocess.rank_assignment.LayerFlag.RESERVE)]
    if c.granularity == "node":
        per_node = launcher_int("LOCAL_WORLD_SIZE", torch.cuda.device_count() or 1)
        layers.append(
            inprocess.rank_assignment.Layer(
                min_ranks=per_node,
                max_ranks=per_node,
                key_or_fn=lambda _: socket.gethostname(),
                flag=inprocess.rank_assignment.LayerFlag.RESERVE,
            )
        )
    aborts = [inprocess.abort.AbortTorchDistributed()]
    if is_installed("transformer_engine"):
        aborts.insert(0, inprocess.abort.AbortTransformerEngine())
    checks = [inprocess.health_check.FaultCounter(max_rank_faults=c.max_rank_faults)]
    finalizers = []
    if torch.cuda.is_available():
        checks.insert(0, inprocess.health_check.CudaHealthCheck(timeout=_seconds(c.heartbeat_timeout)))
        if c.empty_cuda_cache:
            finalizers.append(inprocess.finalize.ThreadedFinalize(timeout=_seconds(10), fn=torch.cuda.empty_cache))
    return inprocess.Wrapper(
        store_kwargs={"timeout": _seconds(c.barrier_timeout), "port": launcher_int("MASTER_PORT") + 2},
        initialize=inprocess.initialize.RetryController(max_iterations=c.max_iterations),
        abort=inprocess.Compose(*aborts),
        finalize=inprocess.Compose(*finalizers) if finalizers else None,
        health_check=inprocess.Compose(*checks),
        rank_assignment=inprocess.rank_assignment.Tree(layers=layers),
        monitor_thread_interval=_seconds(c.monitor_thread_interval),
        monitor_process_interval=_seconds(c.monitor_process_interval),
        progress_watchdog_interval=_seconds(c.progress_watchdog_interval),
        heartbeat_interval=_seconds(c.heartbeat_interval),
        soft_timeout=_seconds(c.soft_timeout),
        hard_timeout=_seconds(c.hard_timeout),
        heartbeat_timeout=_seconds(c.heartbeat_timeout),
        barrier_timeout=_seconds(c.barrier_timeout),
        completion_timeout=_seconds(c.completion_timeout),
        last_call_wait=_seconds(c.last_call_wait),
        termination_grace_time=_seconds(c.termination_grace_time),
        monitor_process_logfile=(
            os.path.join(os.path.abspath(c.monitor_process_logdir), "monitor_{rank}.log") if c.monitor_process_logdir else None
        ),
    )


def run_with_inprocess_restart(
    execute: Callable[..., "GlobalState"],
    config: "ConfigContainer",
    forward_step_func: Callable,
    callbacks: Optional[Iterable["Callback"]] = None,
) -> "GlobalState":
    """Run `execute(config, ...)` under an in-process restart wrapper.

    Each attempt trains a fresh copy of `config`; attempts after the first resume from
    `checkpoint.save` (the last complete checkpoint), through a new process group.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise ProcessGroupExistsError(
            "inprocess_restart.enabled: a torch.distributed process group already exists, but in-process "
            "restart must create (and re-create) it itself (do not initialize torch.distributed before pretrain())"
        )
    with _launcher_environment():
        return _run(execute, config, forward_step_func, list(callbacks or []))


def _run(execute: Callable[..., "GlobalState"], config: "ConfigContainer", forward_step_func: Callable, callbacks: list) -> "GlobalState":
    inprocess = require("nvidia_resiliency_ext.inprocess", "inprocess_restart.enabled")
    base_store = torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=launcher_int("MASTER_PORT") + 1,
        world_size=launcher_int("WORLD_SIZE"),
        is_master=launcher_int("RANK") == 0,
        timeout=_seconds(config.inprocess_restart.barrier_timeout),
        wait_for_workers=True,
        use_libuv=True,
    )

    def attempt(call_wrapper=None):
        tie_children_to_parent()  # the monitor daemon is started; checkpoint writers die with us again
        iteration = call_wrapper.iteration if call_wrapper is not None else 0
        cfg = copy.deepcopy(config)
        if iteration > 0:
            logger.warning("in-process restart %d: resuming from the last checkpoint", iteration)
            if cfg.checkpoint.save:
                cfg.checkpoint.load = cfg.checkpoint.save
        store = torch.distributed.PrefixStore(f"megatron_bridge_{iteration}", base_store)
        return execute(cfg, forward_step_func, callbacks, store=store)

    # The wrapper finds the parameter to pass itself in by its annotation, which must be the
    # class itself (this module's annotations are strings).
    attempt.__annotations__ = {"call_wrapper": Optional[inprocess.CallWrapper]}
    # The wrapper forks its monitor daemon from this process. Garbage the child would collect
    # (a failed run's model or process groups, say) runs native finalizers there, in a copy
    # without the threads those objects belong to, which can crash the monitor: collect it here.
    gc.collect()
    with children_may_outlive_parent():  # the wrapper's monitor is a double-forked daemon
        return build_wrapper(config)(attempt)()
