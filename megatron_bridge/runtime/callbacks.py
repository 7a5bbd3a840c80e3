"""Hooks into a run: subclass `Callback`, override what you need, pass instances to `pretrain`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:
    from megatron_bridge.training.state import GlobalState


class Callback:
    """Called by the train loop on the logging and all other ranks alike."""

    def on_train_start(self, state: "GlobalState") -> None:
        """Before the first step (after setup and any checkpoint load)."""

    def on_step_start(self, state: "GlobalState") -> None:
        """Before each optimizer step; `state.train_state.step` is the step about to run."""

    def on_step_end(self, state: "GlobalState", metrics: dict[str, Any]) -> None:
        """After each step. `metrics`: 'lm loss' (this rank's view, last pipeline stage only),
        'learning_rate', 'grad_norm', 'skipped', 'iteration_time'."""

    def on_eval_start(self, state: "GlobalState") -> None:
        """Before an evaluation."""

    def on_eval_end(self, state: "GlobalState", metrics: dict[str, float]) -> None:
        """After an evaluation, with the averaged losses."""

    def on_train_end(self, state: "GlobalState") -> None:
        """After training (also after a clean early exit)."""


class CallbackList(Callback):
    """Fans each event out to several callbacks, in order."""

    def __init__(self, callbacks: Optional[Iterable[Callback]] = None):
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks: {cb!r} is not a megatron_bridge.training.callbacks.Callback")

    def on_train_start(self, state):
        for cb in self.callbacks:
            cb.on_train_start(state)

    def on_step_start(self, state):
        for cb in self.callbacks:
            cb.on_step_start(state)

    def on_step_end(self, state, metrics):
        for cb in self.callbacks:
            cb.on_step_end(state, metrics)

    def on_eval_start(self, state):
        for cb in self.callbacks:
            cb.on_eval_start(state)

    def on_eval_end(self, state, metrics):
        for cb in self.callbacks:
            cb.on_eval_end(state, metrics)

    def on_train_end(self, state):
        for cb in self.callbacks:
            cb.on_train_end(state)
