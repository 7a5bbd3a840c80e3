"""A run that cannot fit in memory is refused before anything large is allocated.

The planner knows what a config allocates (parameters, gradient buffers and optimizer state byte
for byte, activations per layer). A CPU run whose processes on this machine need more than the
memory the kernel reports available would fail at its first large allocation, or be killed by
the kernel's OOM killer after swapping for minutes; it is refused before the process group is
set up. A GPU run is held against its GPU once each process has one (the device's memory is known
only then): a plan larger than the whole GPU cannot run, and building its batches could take
minutes before the first allocation failed. On every run, the dataloader workers (processes
forked from each training process) are held against this machine's memory too: thousands of
them forked for minutes, then exhausted it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.data.builders import sample_counts
from megatron_bridge.planning import PlanningError, plan
from megatron_bridge.runtime.launcher_env import launcher_int

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer

logger = logging.getLogger(__name__)

GIB = 2**30

WORKER_BYTES = 8 * 2**20
"""Memory a dataloader worker writes of its own, at least (measured: 8-10 MiB private for the
tiny recipe's workers on mock data; more with real datasets and tokenizers)."""


def available_memory() -> Optional[int]:
    """Bytes of memory the kernel can give new allocations without swapping (MemAvailable of
    /proc/meminfo); None where that is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def dataloader_workers(cfg: "ConfigContainer") -> int:
    """Worker processes one training process forks: `dataset.num_workers` for each of the
    train, validation and test loaders the run builds."""
    workers = getattr(cfg.dataset, "num_workers", 0) or 0
    counts = sample_counts(cfg)
    return workers * sum(1 for n in (counts.train, counts.valid, counts.test) if n)


def _model_bytes(cfg: "ConfigContainer") -> Optional[tuple[int, str]]:
    """Planned bytes of one training process and their parts, as text; None where the planner
    does not model the config (or fails on it: logged)."""
    try:
        worst = plan(cfg, with_fixes=False).worst
    except PlanningError:
        return None  # a feature the planner does not model: the run finds out itself
    except Exception as exc:  # noqa: BLE001 - the check must not stop a run the planner cannot plan
        logger.warning("the memory check could not plan this run (%s: %s); it runs unchecked", type(exc).__name__, exc)
        return None
    s = worst.state
    parts = (("parameters", s.params), ("gradients", s.grads), ("optimizer state", s.optimizer), ("activations", worst.activations.total))
    return int(sum(size for _, size in parts)), ", ".join(f"{name} {size / GIB:,.2f}" for name, size in parts)


def refuse_what_host_memory_cannot_hold(cfg: "ConfigContainer", on_cpu: bool = True, available: Optional[int] = None) -> None:
    """Raise `ConfigValidationError` when the training processes on this machine
    (LOCAL_WORLD_SIZE) need more memory than `available` (this machine's, by default): their
    dataloader workers, and on a CPU their model, optimizer and activations as planned."""
    available = available_memory() if available is None else available
    if available is None:
        return
    processes = launcher_int("LOCAL_WORLD_SIZE", 1)
    times = f" x {processes} processes on this machine" if processes > 1 else ""
    workers = dataloader_workers(cfg)
    worker_bytes = workers * WORKER_BYTES
    if worker_bytes * processes > available:
        raise ConfigValidationError(ConfigProblem(
            "dataset.num_workers",
            f"{cfg.dataset.num_workers} workers for each of the run's data loaders fork {workers:,} processes per "
            f"training process{times}, at least {WORKER_BYTES // 2**20} MiB each: more than the {available / GIB:,.1f} "
            "GiB this machine has available",
            "use a few workers per loader (2 to 8 is usual; 0 loads in the training process)",
        ))  # fmt: skip
    model = _model_bytes(cfg) if on_cpu else None
    if model is None:
        return
    per_process, parts = model
    if (per_process + worker_bytes) * processes <= available:
        return
    raise ConfigValidationError(ConfigProblem(
        "",
        f"this CPU run needs about {per_process / GIB:,.1f} GiB of memory per process ({parts} GiB){times}, "
        f"and this machine has {available / GIB:,.1f} GiB available",
        "`--plan-only` shows where it goes; make the model, train.micro_batch_size or model.seq_length smaller",
    ))  # fmt: skip


def refuse_what_the_gpu_cannot_hold(cfg: "ConfigContainer", total: Optional[int] = None, gpu: str = "") -> None:
    """Raise `ConfigValidationError` when one training process's planned parameters, gradients,
    optimizer state and activations exceed `total` bytes (by default the whole memory of this
    process's current CUDA device, named `gpu`)."""
    if total is None:
        import torch

        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        total, gpu = properties.total_memory, properties.name
    model = _model_bytes(cfg)
    if model is None or model[0] <= total:
        return
    per_process, parts = model
    raise ConfigValidationError(ConfigProblem(
        "",
        f"this run needs about {per_process / GIB:,.1f} GiB of GPU memory per process ({parts} GiB), "
        f"more than the {total / GIB:,.1f} GiB of its GPU{f' ({gpu})' if gpu else ''}",
        "`--plan-only` shows where it goes; make the model, train.micro_batch_size or model.seq_length smaller, "
        "or split the model over more GPUs (model.tensor_model_parallel_size, model.pipeline_model_parallel_size)",
    ))  # fmt: skip
