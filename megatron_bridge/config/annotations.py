"""The one interpreter of config field annotations: checking, decoding and encoding values.

A field's declared type says

* whether a value fits it (`type_problem`, `checker_for`): a string where an int is declared is
  refused when the user sets it. What typing cannot express simply (type variables, protocols,
  forward references that do not resolve) is accepted;
* how plain data (from YAML, an override, a recipe keyword) becomes a value (`Decoder`):
  decoding also accepts what people type on a command line: `bf16` for a dtype, an enum member
  name in any case, `silu` for `torch.nn.functional.silu`, numbers in quotes, a number where a
  string is declared;
* how a value is written as plain YAML data (`Encoder`);
* what a key path below the field addresses (`section_classes`, `container_item_type`).

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

Names (`_target_`, functions) resolve only through the registry of `config.targets`, and decoding
calls nothing but config-class constructors.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import inspect
import numbers
import os
import pathlib
import re
import sys
import types
import typing
from collections.abc import Callable as AbcCallable
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Literal, Optional, Union

import torch

from megatron_bridge.config.errors import show
from megatron_bridge.config.targets import (
    SHORT_NAME_NAMESPACES,
    TargetNotAllowedError,
    resolve,
    resolve_short_callable,
    short_callable_names,
)
from megatron_bridge.config.targets import name_of as object_path

TARGET, CALL, PARTIAL, ARGS = "_target_", "_call_", "_partial_", "_args_"
TUPLE, PATH, UNSERIALIZABLE = "_tuple_", "_path_", "_unserializable_"
VALUE_TAGS = frozenset({TUPLE, PATH, UNSERIALIZABLE})

_SCALAR_TYPES = (str, int, float, bool, type(None))

Checker = Callable[[Any], Optional[str]]  # returns why the value does not fit, or None

def describe(tp: Any) -> str:
    """A readable name for a type annotation."""
    if isinstance(tp, type):
        return tp.__name__
    text = repr(tp).replace("typing.", "")
    return text


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


def values_equal(a: Any, b: Any) -> bool:
    """Equality for config values: `functools.partial` compares by function and arguments."""
    if a is b:
        return True
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return (
            values_equal(a.func, b.func)
            and len(a.args) == len(b.args)
            and all(values_equal(x, y) for x, y in zip(a.args, b.args))
            and a.keywords.keys() == b.keywords.keys()
            and all(values_equal(a.keywords[k], b.keywords[k]) for k in a.keywords)
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


def same_value(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (an enum member is not its name)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return values_equal(a, b)



# ====================================================================== checking
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
    if is_any(tp):
        return _ok
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    if union_arms(tp) is not None:
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
    """Whether annotation `tp` admits None."""
    arms = union_arms(tp)
    if arms is not None:
        return type(None) in arms
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


# ====================================================================== decoding
DTYPE_ALIASES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "double": torch.float64,
}
if hasattr(torch, "float8_e4m3fn"):
    DTYPE_ALIASES["fp8"] = torch.float8_e4m3fn

_INT_RE = re.compile(r"[-+]?\d+")
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)", re.IGNORECASE)


class Decoder:
    """Turns plain data (from YAML or an override) into the value a field declares.

    Names (`_target_`, functions) resolve only through the registry of `config.targets`, and
    decoding calls nothing but config-class constructors.
    """

    def section(self, raw: Mapping, declared: tuple[type, ...]) -> Any:
        """Decode a dataclass mapping; overridden by the serializer."""
        raise DecodeError("cannot build dataclasses here")

    def value(self, raw: Any, tp: Any = Any) -> Any:
        """The value for a field declared as `tp`; raises DecodeError explaining a mismatch.

        Conversions (a number in quotes, a number for a string) are allowed; inside a Union they
        are tried only after every arm has refused the value as it is."""
        return _decoder_for(tp)(self, raw, True)

    # ---------------------------------------------------------------- names
    def import_path(self, path: Any) -> Any:
        """The registered object called `path`, as a DecodeError if there is none."""
        if not isinstance(path, str):
            raise DecodeError(f"_target_ must be a name string, {got(path)}", "e.g. 'torch.nn.init.normal_'")
        try:
            return resolve(path)
        except TargetNotAllowedError as exc:
            raise DecodeError(exc.message, exc.fix) from None

    # ---------------------------------------------------------------- untyped
    def any(self, raw: Any) -> Any:
        """Decode data whose type the declaration does not give (honours the tags)."""
        if raw is None or type(raw) in (str, int, float, bool):
            return raw
        if isinstance(raw, list):
            return self._items(raw, lambda v: self.any(v), list)
        if isinstance(raw, Mapping):
            if TARGET in raw:
                return self.instantiate(raw)
            if len(raw) == 1 and next(iter(raw)) in VALUE_TAGS:
                tag, inner = next(iter(raw.items()))
                if tag == TUPLE and isinstance(inner, list):
                    return self._items(inner, lambda v: self.any(v), tuple)
                if tag == PATH and isinstance(inner, str):
                    return pathlib.Path(inner)
                if tag == UNSERIALIZABLE:
                    raise DecodeError(
                        f"the saved value {inner} had no YAML form (a runtime object)",
                        "delete this key to use the default, or set the value in Python after loading",
                    )
            return self._mapping(raw, lambda v: self.any(v))
        return raw

    def instantiate(self, raw: Mapping) -> Any:
        """The object a `_target_` mapping describes: the object itself (`_call_: false`), a
        `functools.partial` of a function (`_partial_: true`, arguments as plain data), or a config
        class built from the remaining keys. Nothing else is called."""
        obj = self.import_path(raw[TARGET])
        if raw.get(CALL) is False:
            extra = [k for k in raw if k not in (TARGET, CALL)]
            if extra:
                raise DecodeError(f"keys {extra} make no sense with _call_: false", "remove them")
            return obj
        if raw.get(PARTIAL):
            if not callable(obj) or isinstance(obj, type):
                raise DecodeError(f"{raw[TARGET]!r} is not a function", "_partial_ needs a function")
            args = raw.get(ARGS, [])
            if not isinstance(args, list):
                raise DecodeError(f"_args_ must be a list, {got(args)}", "e.g. _args_: [1, 2]")
            kwargs = {k: v for k, v in raw.items() if k not in (TARGET, PARTIAL, ARGS, CALL)}
            _check_plain(args, ARGS)
            _check_plain(kwargs, "arguments")
            return functools.partial(obj, *args, **kwargs)
        if isinstance(obj, type) and dataclasses.is_dataclass(obj):
            return self.section(raw, (obj,))
        raise DecodeError(
            f"{raw[TARGET]!r} is not a config class, and configs do not call functions",
            "refer to it with _call_: false, or bind arguments with _partial_: true",
        )

    def _items(self, raw: list, decode: Any, kind: type) -> Any:
        out, errors = [], []
        for i, v in enumerate(raw):
            try:
                out.append(decode(v))
            except DecodeError as exc:
                errors.extend(exc.under(i).items)
        if errors:
            raise DecodeError(items=errors)
        return kind(out)

    def _mapping(self, raw: Mapping, decode: Any) -> dict:
        out, errors = {}, []
        for k, v in raw.items():
            try:
                out[k] = decode(v)
            except DecodeError as exc:
                errors.extend(exc.under(k).items)
        if errors:
            raise DecodeError(items=errors)
        return out


TRIAL_DECODER = Decoder()
"""Reads back an encoding to check it."""


def _check_plain(value: Any, where: str, depth: int = 0) -> None:
    """Arguments bound from a config are plain data: scalars, lists and mappings of them."""
    if isinstance(value, Mapping):
        if TARGET in value or any(k in VALUE_TAGS for k in value):
            raise DecodeError(f"{where} hold a tagged value {show(value)}", "function arguments must be plain data")
        for v in value.values():
            _check_plain(v, where, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_plain(v, where, depth + 1)
    elif not (value is None or type(value) in (str, int, float, bool)):
        raise DecodeError(f"{where} hold {show(value)}", "function arguments must be plain data")


def _tagged(dc: Decoder, raw: Any, tp: Any) -> Any:
    """A tagged mapping where a typed value was expected: decode it, then check its type."""
    value = dc.any(raw)
    if isinstance(value, type) and any(is_callable_type(a) for a in (union_arms(tp) or (tp,))):
        raise DecodeError(f"{raw.get(TARGET)!r} is a class, not a function", "name a function")
    why = checker_for(tp)(value)
    if why:
        raise DecodeError(why, f"use a value of type {describe(tp)}")
    return value


def _is_tagged(raw: Any) -> bool:
    return isinstance(raw, Mapping) and (TARGET in raw or (len(raw) == 1 and next(iter(raw)) in VALUE_TAGS))


@functools.lru_cache(maxsize=None)
def _decoder_for(tp: Any) -> Any:
    try:
        return _build_decoder(tp)
    except TypeError:  # an exotic annotation: read it untyped
        return lambda dc, raw, lenient: dc.any(raw)


def _build_decoder(tp: Any) -> Any:  # noqa: C901 - one branch per kind of annotation
    if is_any(tp):
        return lambda dc, raw, lenient: dc.any(raw)
    if tp is type(None) or tp is None:

        def none(dc, raw, lenient):
            if raw is None:
                return None
            raise DecodeError(f"expected null, {got(raw)}", "remove the key")

        return none
    arms = union_arms(tp)
    if arms is not None:
        return _union_decoder(tp, arms)
    origin = typing.get_origin(tp) or tp
    args = typing.get_args(tp)
    fix = f"use a value of type {describe(tp)}"

    def typed(check):
        """Wrap a decoder: None is refused, tagged mappings are decoded and type-checked."""

        def decode(dc, raw, lenient):
            if raw is None:
                raise DecodeError(f"expected {describe(tp)}, got null", fix)
            if _is_tagged(raw) and not (dataclasses.is_dataclass(origin) and TARGET in raw):
                return _tagged(dc, raw, tp)
            return check(dc, raw, lenient)

        return decode

    if origin is Literal:

        def literal(dc, raw, lenient):
            for a in args:
                if raw == a and type(raw) is type(a):
                    return a
            if lenient and isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
                for a in args:
                    if str(a) == str(raw):
                        return a
            hint = suggest(raw, args) if isinstance(raw, str) else ""
            raise DecodeError(f"expected one of {list(args)}, {got(raw)}", hint or f"use one of {list(args)}")

        return typed(literal)
    if tp is bool:

        def boolean(dc, raw, lenient):
            if isinstance(raw, bool):
                return raw
            if lenient and isinstance(raw, str) and raw.lower() in ("true", "false"):
                return raw.lower() == "true"
            raise DecodeError(f"expected bool, {got(raw)}", "use true or false")

        return typed(boolean)
    if tp is int:

        def integer(dc, raw, lenient):
            if isinstance(raw, int) and not isinstance(raw, bool):
                return raw
            if lenient and isinstance(raw, str) and _INT_RE.fullmatch(raw.strip()):
                return int(raw)
            if lenient and isinstance(raw, float) and raw.is_integer():
                return int(raw)
            raise DecodeError(f"expected int, {got(raw)}", "use a whole number, e.g. 8")

        return typed(integer)
    if tp is float:

        def real(dc, raw, lenient):
            if isinstance(raw, (int, float)) and not isinstance(raw, bool):
                return raw  # an int stays an int: megatron-core has float fields with int defaults
            if lenient and isinstance(raw, str) and _FLOAT_RE.fullmatch(raw.strip()):
                return float(raw)
            raise DecodeError(f"expected float, {got(raw)}", "use a number, e.g. 0.1 or 1e-4")

        return typed(real)
    if tp is str:

        def string(dc, raw, lenient):
            if isinstance(raw, str):
                return raw
            if lenient and isinstance(raw, (int, float)) and not isinstance(raw, bool):
                return str(raw)
            raise DecodeError(f"expected str, {got(raw)}", "quote the value")

        return typed(string)
    if origin is torch.dtype:

        def dtype(dc, raw, lenient):
            if isinstance(raw, torch.dtype):
                return raw
            if isinstance(raw, str):
                name = raw.strip().lower().removeprefix("torch.")
                found = DTYPE_ALIASES.get(name, getattr(torch, name, None) if name.isidentifier() else None)
                if isinstance(found, torch.dtype):
                    return found
            raise DecodeError(
                f"expected a torch dtype, {got(raw)}", "use e.g. bfloat16, bf16, float16, fp16 or float32"
            )

        return typed(dtype)
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return typed(_enum_decoder(origin))
    if isinstance(origin, type) and issubclass(origin, pathlib.PurePath):

        def path(dc, raw, lenient):
            if isinstance(raw, origin):
                return raw
            if isinstance(raw, str):
                return origin(raw)
            raise DecodeError(f"expected a path, {got(raw)}", "use a string")

        return typed(path)
    if origin in (list, tuple, set, frozenset, Sequence):
        return typed(_sequence_decoder(tp, origin, args))
    if origin in (dict, Mapping):
        item = _decoder_for(args[1]) if len(args) == 2 else _decoder_for(Any)

        def mapping(dc, raw, lenient):
            if not isinstance(raw, Mapping):
                raise DecodeError(f"expected a mapping, {got(raw)}", "use {key: value, ...}")
            return dc._mapping(raw, lambda v: item(dc, v, lenient))

        return typed(mapping)
    if is_callable_type(tp):

        def function(dc, raw, lenient):
            if isinstance(raw, str):
                obj = dc.import_path(raw) if "." in raw else resolve_short_callable(raw)
                if obj is None:
                    where = " or ".join(SHORT_NAME_NAMESPACES)
                    hint = suggest(raw, short_callable_names())
                    raise DecodeError(
                        f"no function {raw!r} in {where}", hint or "give its import path, e.g. mypkg.mod.fn"
                    )
                if callable(obj) and not isinstance(obj, type):
                    return obj
                raise DecodeError(f"{raw!r} is not a function", "name a function, e.g. torch.nn.functional.silu")
            if callable(raw):
                return raw
            raise DecodeError(f"expected a function, {got(raw)}", "use an import path such as torch.nn.functional.silu")

        return typed(function)
    if isinstance(origin, type) and dataclasses.is_dataclass(origin):

        def section(dc, raw, lenient):
            if isinstance(raw, origin):
                return raw
            if isinstance(raw, Mapping):
                return dc.section(raw, (origin,))
            if isinstance(raw, str) and raw.strip().lower() == getattr(origin, "config_name", None):
                return origin()  # a section selected by its short name (`peft=lora`), with its defaults
            raise DecodeError(f"expected a {origin.__name__} mapping, {got(raw)}", "use {field: value, ...}")

        return typed(section)

    def other(dc, raw, lenient):
        why = checker_for(tp)(raw)
        if why:
            raise DecodeError(why, fix)
        return raw

    return typed(other)


def _enum_decoder(cls: type) -> Any:
    names = list(cls.__members__)
    folded = {n.lower(): m for n, m in cls.__members__.items()}

    def decode(dc, raw, lenient):
        if isinstance(raw, cls):
            return raw
        if isinstance(raw, str):
            name = raw.strip().rsplit(".", 1)[-1]
            member = cls.__members__.get(name) or folded.get(name.lower())
            if member is not None:
                return member
        elif not isinstance(raw, bool):
            try:
                return cls(raw)
            except (ValueError, TypeError):
                pass
        hint = suggest(raw, names) if isinstance(raw, str) else ""
        raise DecodeError(f"expected {cls.__name__} (one of {names}), {got(raw)}", hint or f"use one of {names}")

    return decode


def _sequence_decoder(tp: Any, origin: Any, args: tuple) -> Any:
    items = [a for a in args if a is not Ellipsis]
    kind = {list: list, Sequence: list, tuple: tuple, set: set, frozenset: frozenset}[origin]
    positional = origin is tuple and len(items) > 1 and Ellipsis not in args
    per_item = [_decoder_for(a) for a in items] if positional else None
    item = _decoder_for(items[0]) if len(items) == 1 else _decoder_for(Any)

    def decode(dc, raw, lenient):
        if not isinstance(raw, (list, tuple)):
            raise DecodeError(f"expected {describe(tp)}, {got(raw)}", "use a list, e.g. [a, b]")
        if per_item is not None:
            if len(raw) != len(per_item):
                raise DecodeError(f"expected {len(per_item)} items, got {len(raw)}: {show(raw)}", f"use {describe(tp)}")
            out = dc._items(list(zip(per_item, raw)), lambda pair: pair[0](dc, pair[1], lenient), list)
            return tuple(out)
        return dc._items(list(raw), lambda v: item(dc, v, lenient), kind)

    return decode


def _union_decoder(tp: Any, arms: tuple) -> Any:
    none_ok = type(None) in arms
    real = [a for a in arms if a is not type(None)]
    if len(real) == 1:
        single = _decoder_for(real[0])

        def optional(dc, raw, lenient):
            return None if raw is None else single(dc, raw, lenient)

        return optional if none_ok else single
    decoders = [_decoder_for(a) for a in real]
    classes = [a for a in real if isinstance(a, type) and dataclasses.is_dataclass(a)]

    def decode(dc, raw, lenient):
        if raw is None:
            if none_ok:
                return None
            raise DecodeError(f"expected {describe(tp)}, got null", f"use a value of type {describe(tp)}")
        if classes and any(isinstance(raw, c) for c in classes):
            return raw
        if classes and isinstance(raw, Mapping) and not (len(raw) == 1 and next(iter(raw)) in VALUE_TAGS):
            if TARGET in raw or not any(typing.get_origin(a) in (dict, Mapping) or a in (dict, Mapping) for a in real):
                return dc.section(raw, tuple(classes))
        if _is_tagged(raw):
            return _tagged(dc, raw, tp)  # decoded once: a _target_ call must not run per arm
        for mode in (False, True) if lenient else (False,):
            for decoder in decoders:
                try:
                    return decoder(dc, raw, mode)
                except DecodeError:
                    pass
        named = [c.config_name for c in classes if isinstance(getattr(c, "config_name", None), str)]
        if named and isinstance(raw, str):
            hint = suggest(raw, named)
            raise DecodeError(f"expected {' or '.join(map(repr, named))} or a mapping, {got(raw)}", hint or f"use one of {named}")
        raise DecodeError(f"expected {describe(tp)}, {got(raw)}", f"use a value of type {describe(tp)}")

    return decode


# ====================================================================== key paths below a field
def _arms(tp: Any) -> tuple:
    arms = union_arms(tp)
    return (tp,) if arms is None else tuple(a for a in arms if a is not type(None))


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
