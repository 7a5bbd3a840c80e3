"""A CPU run that cannot fit in this machine's memory is refused before anything is allocated.

The planner knows what a config allocates (parameters, gradient buffers and optimizer state byte
for byte, activations per layer): a CPU run whose processes on this machine need more than the
memory the kernel reports available would fail at its first large allocation, or be killed by
the kernel's OOM killer after swapping for minutes. GPU runs are planned against their GPU with
`--plan-only` (the allocator reports the device's memory only once CUDA is up on each rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_bridge.config.errors import ConfigValidationError, ConfigProblem
from megatron_bridge.runtime.launcher_env import launcher_int

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer

GIB = 2**30


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


def refuse_what_host_memory_cannot_hold(cfg: "ConfigContainer", available: Optional[int] = None) -> None:
    """Raise `ConfigValidationError` when the processes of a CPU run on this machine
    (LOCAL_WORLD_SIZE) need more memory, as planned, than `available` (this machine's, by default)."""
    from megatron_bridge.planning import PlanningError, plan

    available = available_memory() if available is None else available
    if available is None:
        return
    try:
        worst = plan(cfg, with_fixes=False).worst
    except PlanningError:
        return  # a feature the planner does not model: the run finds out itself
    s = worst.state
    per_process = s.params + s.grads + s.optimizer + worst.activations.total  # no GPU workspace on a CPU
    processes = launcher_int("LOCAL_WORLD_SIZE", 1)
    if per_process * processes <= available:
        return
    parts = ", ".join(f"{name} {size / GIB:,.2f}" for name, size in (("parameters", s.params), ("gradients", s.grads),
                      ("optimizer state", s.optimizer), ("activations", worst.activations.total)))  # fmt: skip
    times = f" x {processes} processes on this machine" if processes > 1 else ""
    raise ConfigValidationError(
        ConfigProblem(
            "",
            f"this CPU run needs about {per_process / GIB:,.1f} GiB of memory per process ({parts} GiB){times}, "
            f"and this machine has {available / GIB:,.1f} GiB available",
            "`--plan-only` shows where it goes; make the model, train.micro_batch_size or model.seq_length smaller",
        )
    )
