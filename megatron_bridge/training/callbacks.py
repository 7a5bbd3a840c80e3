"""Hooks into a run: subclass `Callback`, override what you need, pass instances to `pretrain`.

The public import path of `megatron_bridge.runtime.callbacks` (where the protocol lives, below the
packages that implement callbacks)."""

from megatron_bridge.runtime.callbacks import Callback, CallbackList

__all__ = ["Callback", "CallbackList"]
