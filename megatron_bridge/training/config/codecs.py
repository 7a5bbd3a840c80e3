"""Config values to plain YAML data, guided by each field's declared type (`decoders` reads
them back).

Where the declared type says what a value is, the YAML holds the plain, readable form
(`params_dtype: bfloat16`, `exit_signal: SIGTERM`, `activation_func: torch.nn.functional.silu`,
tuples and Paths as lists and strings). Where it does not (`Any`, or a `Union` whose arms would
read the plain form differently), a tagged mapping is written instead:

* `{_target_: pkg.mod.obj, _call_: false}`: the object at that import path (dtype, enum member,
  function);
* `{_target_: pkg.mod.fn, _partial_: true, _args_: [...], key: value}`: `functools.partial`;
* `{_target_: pkg.mod.Class, ...}`: a dataclass (fields as keys), or a call of the target;
* `{_tuple_: [...]}`, `{_path_: "..."}`: a tuple, a `pathlib.Path`;
* `{_unserializable_: "<repr>"}`: a runtime object that has no YAML form; loading it fails,
  unless the framework (not the user) had set it: then the field takes its default.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import numbers
import pathlib
import sys
import types
import typing
from collections.abc import Callable as AbcCallable
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional, Union

import torch

from megatron_bridge.config.base import values_equal
from megatron_bridge.config.errors import show
from megatron_bridge.config.targets import name_of as object_path

TARGET, CALL, PARTIAL, ARGS = "_target_", "_call_", "_partial_", "_args_"
TUPLE, PATH, UNSERIALIZABLE = "_tuple_", "_path_", "_unserializable_"
VALUE_TAGS = frozenset({TUPLE, PATH, UNSERIALIZABLE})

_SCALAR_TYPES = (str, int, float, bool, type(None))


class DecodeError(Exception):
    """One or more problems decoding a value, as (dotted path below the value, message, fix)."""

    def __init__(self, message: str = "", fix: str = "", items: Optional[list[tuple[str, str, str]]] = None):
        self.items = items if items is not None else [("", message, fix)]
        super().__init__("; ".join(m for _, m, _ in self.items))

    def under(self, name: Any) -> "DecodeError":
        """The same problems with `name` prepended to their paths."""
        key = str(name)
        return DecodeError(items=[(f"{key}.{p}" if p else key, m, f) for p, m, f in self.items])


def is_placeholder(raw: Any) -> bool:
    """Whether `raw` is the `{_unserializable_: ...}` stand-in for a runtime object."""
    return isinstance(raw, Mapping) and len(raw) == 1 and UNSERIALIZABLE in raw


class FlowList(list):
    """A list of scalars; written on one line in YAML (`[1, 2]`) for readability."""


def suggest(word: str, candidates: Any) -> str:
    """'did you mean ...?' text for the closest candidates, or ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=3, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def got(raw: Any) -> str:
    """'got <type> <value>' for error messages."""
    return f"got {type(raw).__name__} {show(raw)}"


def union_arms(tp: Any) -> Optional[tuple]:
    """The arms of a Union/Optional annotation, or None if `tp` is not one."""
    origin = typing.get_origin(tp)
    if origin is Union or (sys.version_info >= (3, 10) and origin is types.UnionType):
        return typing.get_args(tp)
    return None


def is_any(tp: Any) -> bool:
    """Whether annotation `tp` says nothing about the value (Any, object, a type variable...)."""
    return tp is Any or tp is object or isinstance(tp, (typing.TypeVar, str, typing.ForwardRef))


def is_callable_type(tp: Any) -> bool:
    """Whether annotation `tp` is `Callable` (bare or parametrized)."""
    origin = typing.get_origin(tp)
    return tp is typing.Callable or tp is AbcCallable or origin is AbcCallable


def _matches(arm: Any, value: Any) -> bool:
    """Whether `value` is exactly of kind `arm` (no conversions), to pick a Union arm."""
    if is_any(arm):
        return True
    origin = typing.get_origin(arm) or arm
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(arm))
    if is_callable_type(arm):
        return callable(value)
    if origin in (list, Sequence):
        return isinstance(value, list)
    if origin in (dict, Mapping):
        return isinstance(value, dict)
    if arm in (int, bool, str, float):
        return type(value) is arm
    return isinstance(origin, type) and isinstance(value, origin)


def same_value(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (an enum member is not its name)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return values_equal(a, b)


# ====================================================================== encoding
class Encoder:
    """Turns config values into plain data (dicts, lists, scalars) for YAML."""

    def section(self, obj: Any) -> dict:
        """Encode a dataclass instance; overridden by the serializer (explicit-field tracking)."""
        raise NotImplementedError

    def value(self, value: Any, tp: Any = Any) -> Any:
        """Plain form of `value` for a field declared as `tp`."""
        if value is None or type(value) in (str, int, float, bool):
            return value
        if isinstance(value, numbers.Real) and not isinstance(value, (enum.Enum, bool)):
            return int(value) if isinstance(value, numbers.Integral) else float(value)  # numpy scalars
        arms = union_arms(tp)
        if arms is not None:
            real = [a for a in arms if a is not type(None)]
            if len(real) == 1:
                return self.value(value, real[0])
            return self._union(value, tp, real)
        if is_any(tp):
            return self.any(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self.section(value)
        if isinstance(value, functools.partial):
            return self.partial(value)
        origin = typing.get_origin(tp) or tp
        if isinstance(value, enum.Enum) and isinstance(origin, type) and issubclass(origin, enum.Enum):
            return value.name
        if isinstance(value, torch.dtype) and origin is torch.dtype:
            return str(value).replace("torch.", "")
        if isinstance(value, pathlib.PurePath) and isinstance(origin, type) and issubclass(origin, pathlib.PurePath):
            return str(value)
        if (isinstance(value, list) and origin in (list, Sequence)) or (isinstance(value, tuple) and origin is tuple):
            args = [a for a in typing.get_args(tp) if a is not Ellipsis]
            if origin is tuple and len(args) > 1 and len(args) == len(value):
                return self._list(self.value(v, a) for v, a in zip(value, args))
            item = args[0] if len(args) == 1 else Any
            return self._list(self.value(v, item) for v in value)
        if isinstance(value, dict) and origin in (dict, Mapping):
            args = typing.get_args(tp)
            item = args[1] if len(args) == 2 else Any
            return {k: self.value(v, item) for k, v in value.items()}
        if is_callable_type(tp) or origin is type:
            path = object_path(value)
            if path is not None:
                return path
        return self.any(value)

    def any(self, value: Any) -> Any:
        """Plain form of a value whose type the declaration does not give (tags where needed)."""
        if value is None or type(value) in (str, int, float, bool):
            return value
        if isinstance(value, numbers.Real) and not isinstance(value, (enum.Enum, bool)):
            return int(value) if isinstance(value, numbers.Integral) else float(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self.section(value)
        if isinstance(value, functools.partial):
            return self.partial(value)
        if type(value) is list:
            return self._list(self.any(v) for v in value)
        if type(value) is tuple:
            return {TUPLE: self._list(self.any(v) for v in value)}
        if type(value) is dict:
            return {k: self.any(v) for k, v in value.items()}
        if isinstance(value, pathlib.PurePath):
            return {PATH: str(value)}
        path = object_path(value) if isinstance(value, (enum.Enum, torch.dtype)) or callable(value) else None
        if isinstance(value, torch.dtype):
            path = str(value)
        if path is not None:
            return {TARGET: path, CALL: False}
        return {UNSERIALIZABLE: show(value)}

    def partial(self, value: functools.partial) -> Any:
        """`{_target_: func, _partial_: true, _args_: [...], **keywords}`."""
        path = object_path(value.func)
        if path is None:
            return {UNSERIALIZABLE: show(value)}
        out: dict[str, Any] = {TARGET: path, PARTIAL: True}
        if value.args:
            out[ARGS] = self._list(self.any(a) for a in value.args)
        for k, v in value.keywords.items():
            out[k] = self.any(v)
        return out

    def _union(self, value: Any, tp: Any, arms: list) -> Any:
        if (dataclasses.is_dataclass(value) and not isinstance(value, type)) or isinstance(value, functools.partial):
            return self.any(value)  # self-describing through _target_
        for arm in arms:
            if _matches(arm, value):
                plain = self.value(value, arm)
                from megatron_bridge.training.config.decoders import TRIAL_DECODER

                try:
                    back = TRIAL_DECODER.value(plain, tp)
                except DecodeError:
                    break
                if same_value(back, value):
                    return plain
                break
        return self.any(value)

    @staticmethod
    def _list(items: Any) -> list:
        out = list(items)
        return FlowList(out) if all(type(v) in _SCALAR_TYPES for v in out) else out
