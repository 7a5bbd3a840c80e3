"""Checks a value against a field's declared type.

Used when a user sets a field (constructor argument, attribute assignment, YAML, override), so a
string where an int is declared is refused at once instead of being stored. Judges what typing
can express simply (scalars, Literal, Optional/Union, enums, dtypes, callables, containers and
their items) and accepts what it cannot judge (type variables, protocols, forward references that
do not resolve).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import sys
import types
import typing
from collections.abc import Callable as AbcCallable
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Literal, Optional, Union

Checker = Callable[[Any], Optional[str]]  # returns why the value does not fit, or None


def describe(tp: Any) -> str:
    """A readable name for a type annotation."""
    if isinstance(tp, type):
        return tp.__name__
    text = repr(tp).replace("typing.", "")
    return text


def _ok(_value: Any) -> None:
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@functools.lru_cache(maxsize=None)
def checker_for(tp: Any) -> Checker:
    """Build (once per annotation) a function that explains why a value does not fit `tp`."""
    try:
        return _build(tp)
    except TypeError:  # unhashable or exotic annotation: accept
        return _ok


def _build(tp: Any) -> Checker:
    name = describe(tp)
    if tp is Any or tp is object or isinstance(tp, (typing.TypeVar, str, typing.ForwardRef)):
        return _ok
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    if origin is Union or (sys.version_info >= (3, 10) and origin is types.UnionType):
        arms = [checker_for(a) for a in args]

        def check_union(value: Any) -> Optional[str]:
            for arm in arms:
                if arm(value) is None:
                    return None
            return f"expected {name}, got {type(value).__name__} {value!r}"

        return check_union

    if origin is Literal:
        allowed = args

        def check_literal(value: Any) -> Optional[str]:
            for a in allowed:
                if value == a and type(value) is type(a):
                    return None
            return f"expected one of {list(allowed)}, got {value!r}"

        return check_literal

    if tp is bool:
        return lambda v: None if isinstance(v, bool) else f"expected bool, got {type(v).__name__} {v!r}"
    if tp is int:
        return lambda v: (
            None if isinstance(v, int) and not isinstance(v, bool) else f"expected int, got {type(v).__name__} {v!r}"
        )
    if tp is float:
        return lambda v: None if _is_number(v) else f"expected float, got {type(v).__name__} {v!r}"
    if tp is str:
        return lambda v: (
            None if isinstance(v, (str, os.PathLike)) else f"expected str, got {type(v).__name__} {v!r}"
        )

    if origin in (list, tuple, set, frozenset) or tp in (list, tuple, set, frozenset) or origin is Sequence:
        item_args = [a for a in args if a is not Ellipsis]
        item = checker_for(item_args[0]) if len(item_args) == 1 and (origin is not tuple or Ellipsis in args) else None
        if origin is tuple and len(item_args) > 1 and Ellipsis not in args:
            per_position = [checker_for(a) for a in item_args]
        else:
            per_position = None

        def check_sequence(value: Any) -> Optional[str]:
            if not isinstance(value, (list, tuple)):
                return f"expected {name}, got {type(value).__name__} {value!r}"
            if per_position is not None:
                if len(value) != len(per_position):
                    return f"expected {name} with {len(per_position)} items, got {len(value)}"
                for c, v in zip(per_position, value):
                    why = c(v)
                    if why:
                        return f"item {v!r}: {why}"
            elif item is not None:
                for v in value:
                    why = item(v)
                    if why:
                        return f"item {v!r}: {why}"
            return None

        return check_sequence

    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return lambda v: None if isinstance(v, Mapping) else f"expected {name}, got {type(v).__name__} {v!r}"

    if origin is AbcCallable or tp is Callable or tp is AbcCallable or origin is type(Callable):
        return lambda v: None if callable(v) else f"expected a callable, got {type(v).__name__} {v!r}"

    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return lambda v: None if isinstance(v, tp) else f"expected {name} (one of {[m.name for m in tp]}), got {v!r}"
        if dataclasses.is_dataclass(tp) or tp.__module__.startswith(("torch", "megatron", "pathlib")):
            return lambda v: None if isinstance(v, tp) else f"expected {name}, got {type(v).__name__} {v!r}"
        return lambda v: None if isinstance(v, tp) else f"expected {name}, got {type(v).__name__} {v!r}"
    return _ok


def allows_none(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Union or (sys.version_info >= (3, 10) and origin is types.UnionType):
        return type(None) in typing.get_args(tp)
    return tp is Any or tp is None or tp is type(None)


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of every dataclass field of `cls` (cached per class)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: fall back to the raw ones
        hints = {}
        for klass in reversed(cls.__mro__):
            hints.update(getattr(klass, "__annotations__", {}))
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


@functools.lru_cache(maxsize=None)
def none_defaults(cls: type) -> frozenset[str]:
    """Fields whose default is None even though their annotation does not say Optional."""
    return frozenset(f.name for f in dataclasses.fields(cls) if f.default is None)


def type_problem(cls: type, name: str, value: Any) -> Optional[str]:
    """Why `value` does not fit field `name` of `cls`, or None if it fits."""
    tp = field_types(cls).get(name)
    if tp is None:
        return None
    if value is None:
        if allows_none(tp) or name in none_defaults(cls):
            return None
        return f"expected {describe(tp)}, got None"
    return checker_for(tp)(value)
