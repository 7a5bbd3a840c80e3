"""The adapter between user forward-step functions and what megatron-core's schedules call
(the standard GPT step itself is `gpt_step.forward_step`)."""

from __future__ import annotations

import functools
import inspect
from typing import Callable

from megatron_bridge.training.state import GlobalState


def wants_state(func: Callable) -> bool:
    """True if `func`'s first parameter is named `state` or annotated with `GlobalState`."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return False
    if not params:
        return False
    first = params[0]
    annotation = first.annotation
    return first.name == "state" or annotation is GlobalState or annotation == "GlobalState"


def prepare_forward_step(func: Callable, state: GlobalState) -> Callable:
    """`func` as megatron-core calls it: `(data_iterator, model[, return_schedule_plan])`.

    Accepts `(data_iterator, model)`, `(state, data_iterator, model)` and
    `(data_iterator, model, return_schedule_plan)` signatures; `state` is injected when wanted.
    """
    if not callable(func):
        raise TypeError(f"forward_step_func must be callable, got {func!r}")
    return functools.partial(func, state) if wants_state(func) else func
