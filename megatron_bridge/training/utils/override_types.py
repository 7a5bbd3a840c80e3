"""What a declared field type says about the key path below it (for overrides)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union


def _arms(tp: Any) -> tuple:
    origin = typing.get_origin(tp)
    if origin is Union or (sys.version_info >= (3, 10) and origin is types.UnionType):
        return tuple(a for a in typing.get_args(tp) if a is not type(None))
    return (tp,)


@functools.lru_cache(maxsize=None)
def section_classes(tp: Any) -> tuple[type, ...]:
    """The concrete dataclasses a field declared as `tp` may hold (Optional/Union unpacked)."""
    return tuple(
        a for a in _arms(tp) if isinstance(a, type) and dataclasses.is_dataclass(a) and not inspect.isabstract(a)
    )


def section_from_value(value: Any, tp: Any) -> Optional[Any]:
    """The dataclass section that key paths below a field address: the value itself, or the
    config a preset name stands for (`mixed_precision=bf16_mixed` then `mixed_precision.fp8=...`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value
    if isinstance(value, str):
        from megatron_bridge.training.mixed_precision import MixedPrecisionConfig, get_mixed_precision_config

        if MixedPrecisionConfig in section_classes(tp):
            return get_mixed_precision_config(value)
    return None


def container_item_type(tp: Any, key: Any, kind: type) -> Optional[Any]:
    """The declared type of item `key` of a container of `kind` (dict, list or tuple) in a field
    declared as `tp`; Any when the declaration does not say, None when `tp` allows no such
    container."""
    for arm in _arms(tp):
        if arm is Any or arm is object:
            return Any
        origin = typing.get_origin(arm) or arm
        args = typing.get_args(arm)
        if kind is dict and origin in (dict, Mapping):
            return args[1] if len(args) == 2 else Any
        if kind in (list, tuple) and origin in (list, tuple, Sequence):
            items = [a for a in args if a is not Ellipsis]
            if origin is tuple and len(items) > 1 and Ellipsis not in args:
                return items[key] if isinstance(key, int) and key < len(items) else Any
            return items[0] if len(items) == 1 else Any
    return None
