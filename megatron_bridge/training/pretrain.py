"""`pretrain()`: train a model from a `ConfigContainer`."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from megatron_bridge.runtime.callbacks import Callback
from megatron_bridge.training.config import ConfigContainer
from megatron_bridge.training.state import GlobalState
from megatron_bridge.training.runner import run_job
from megatron_bridge.warning_filters import quiet_known_warnings


def pretrain(config: ConfigContainer, forward_step_func: Callable, callbacks: Optional[Iterable[Callback]] = None) -> GlobalState:
    """Resolve `config` (`runtime_config_update`), set up, train, evaluate, shut down.

    Works under `torchrun` (any number of processes; NCCL on GPUs, gloo on CPUs) and as a plain
    process (it then creates a 1-process group and destroys it at the end). `forward_step_func`
    takes `(data_iterator, model)`, `(state, data_iterator, model)` or
    `(data_iterator, model, return_schedule_plan)`; `megatron_bridge.training.gpt_step.forward_step`
    is the standard GPT step. Returns the final `GlobalState` (counters, config).
    """
    quiet_known_warnings()

    return run_job(config, forward_step_func, callbacks)
