"""What config field annotations allow: whether a value fits (`type_problem`, `checker_for`; what
typing cannot express simply, such as type variables, protocols and forward references that do not
resolve, is accepted), the forms of values in YAML (read and written by `config.codec`), and what a
key path below a field addresses (`section_classes`, `container_item_type`).

Where the declared type says what a value is, the YAML holds the plain, readable form
(`params_dtype: bfloat16`, `exit_signal: SIGTERM`, `activation_func: torch.nn.functional.silu`,
tuples and Paths as lists and strings). Where it does not (`Any`, or a `Union` whose arms would
read the plain form differently), a tagged mapping is written instead:

* `{_target_: pkg.mod.obj, _call_: false}`: the object at that import path (dtype, enum member, function);
* `{_target_: pkg.mod.fn, _partial_: true, _args_: [...], key: value}`: `functools.partial`;
* `{_target_: pkg.mod.Class, ...}`: a dataclass, its fields as keys;
* `{_tuple_: [...]}`, `{_path_: "..."}`: a tuple, a `pathlib.Path`;
* `{_unserializable_: "<repr>"}`: a runtime object that has no YAML form; loading it fails,
  unless the framework (not the user) had set it: then the field takes its default.

Nothing here imports torch: a torch dtype can only be met once torch is imported.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import inspect
import itertools
import os
import pathlib
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Optional, Union

from megatron_bridge.config.errors import show


TARGET, CALL, PARTIAL, ARGS = "_target_", "_call_", "_partial_", "_args_"
TUPLE, PATH, UNSERIALIZABLE = "_tuple_", "_path_", "_unserializable_"
VALUE_TAGS = frozenset({TUPLE, PATH, UNSERIALIZABLE})

Checker = Callable[[Any], Optional[str]]  # returns why the value does not fit, or None


def describe(tp: Any) -> str:
    """A readable name for a type annotation."""
    return tp.__name__ if isinstance(tp, type) else repr(tp).replace("typing.", "")


class DecodeError(Exception):
    """One or more problems decoding a value, as (dotted path below the value, message, fix)."""

    def __init__(self, message: str = "", fix: str = "", items: Optional[list[tuple[str, str, str]]] = None):
        self.items = items if items is not None else [("", message, fix)]
        super().__init__("; ".join(m for _, m, _ in self.items))

    def under(self, name: Any) -> "DecodeError":
        """The same problems with `name` prepended to their paths."""
        return DecodeError(items=[(f"{name}.{p}" if p else str(name), m, f) for p, m, f in self.items])

    def report(self, problems: Any, path: str = "", source: str = "") -> None:
        """Add each problem to `problems` (a `Problems`) below `path`, tagged with `source` if given."""
        for sub, message, fix in self.items:
            problems.add(".".join(p for p in (path, sub) if p), message, fix, source=source)


def is_value_tag(raw: Any) -> bool:
    """Whether `raw` is a one-key mapping tagged `_tuple_`, `_path_` or `_unserializable_`."""
    return isinstance(raw, Mapping) and len(raw) == 1 and next(iter(raw)) in VALUE_TAGS


class FlowList(list):
    """A list of scalars; written on one line in YAML (`[1, 2]`) for readability."""


def suggest(word: str, candidates: Any) -> str:
    """'did you mean ...?' text for the closest candidates, or ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=3, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def torch_dtype() -> Optional[type]:
    """`torch.dtype` if torch is imported, else None (then no value or annotation can be one)."""
    return getattr(sys.modules.get("torch"), "dtype", None)


def real_arms(tp: Any) -> tuple:
    """The arms of `tp` other than None (`tp` itself when it is not a Union)."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return (tp,)
    return tuple(a for a in typing.get_args(tp) if a is not type(None))


SEQUENCE_KINDS = {list: list, Sequence: list, tuple: tuple, set: set, frozenset: frozenset}
"""Sequence annotations (bare or parametrized) and the container a decoded value becomes."""


def item_types(tp: Any) -> tuple[Optional[tuple], Any]:
    """(the item types by position, Any) for a fixed-length tuple annotation such as `tuple[int, str]`;
    else (None, the type of every item, or of every value of a mapping, Any when it does not say)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (dict, Mapping):
        return None, args[1] if len(args) == 2 else Any
    items = [a for a in args if a is not Ellipsis]
    if typing.get_origin(tp) is tuple and len(items) > 1 and Ellipsis not in args:
        return tuple(items), Any
    return None, items[0] if len(items) == 1 else Any


_KINDS = {bool: "bool", int: "int", float: "float", str: "str", Literal: "literal", dict: "mapping", Mapping: "mapping"}
_KINDS.update({Callable: "callable", **dict.fromkeys(SEQUENCE_KINDS, "sequence")})  # Callable: typing.Callable too
"""The kinds (see `kind_of`) of annotations, or of their origins, that a lookup tells."""


@functools.lru_cache(maxsize=None)
def kind_of(tp: Any) -> str:
    """What annotation `tp` declares, in one word: 'any', 'none', 'union', 'literal', 'bool',
    'int', 'float', 'str', 'dtype' (torch), 'sequence', 'mapping', 'callable', 'enum', 'path',
    'section' (a dataclass), 'class' (another class) or 'other'. Checking, decoding and
    encoding each act on these kinds."""
    if tp is Any or tp is object or isinstance(tp, (typing.TypeVar, str, typing.ForwardRef)):
        return "any"  # the annotation says nothing about the value
    if tp is None or tp is type(None):
        return "none"
    if typing.get_origin(tp) in (Union, types.UnionType):
        return "union"
    origin = typing.get_origin(tp) or tp
    if origin in _KINDS:
        return _KINDS[origin]
    if origin is torch_dtype():
        return "dtype"
    if not isinstance(origin, type):
        return "other"
    if issubclass(origin, enum.Enum):
        return "enum"
    if issubclass(origin, pathlib.PurePath):
        return "path"
    return "section" if dataclasses.is_dataclass(origin) else "class"


def values_equal(a: Any, b: Any, strict: bool = False) -> bool:
    """Equality for config values (a `functools.partial` compares by function and arguments);
    `strict`: of the same types all the way down too (an enum member is not its name)."""
    if a is b:
        return True
    if strict and type(a) is not type(b):
        return False
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return values_equal((a.func, a.args, a.keywords), (b.func, b.args, b.keywords), strict)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y, strict) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k], strict) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


# ====================================================================== checking
def is_number(value: Any) -> bool:
    """Whether `value` is an int or a float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def got(value: Any) -> str:
    """'got <type> <value>' for error messages."""
    return f"got {type(value).__name__} {show(value)}"


def _ok(_value: Any) -> None:
    return None


SCALAR_CHECKERS: dict[str, Checker] = {  # written out: checking runs on every assignment
    "bool": lambda v: None if isinstance(v, bool) else f"expected bool, {got(v)}",
    "int": lambda v: None if isinstance(v, int) and not isinstance(v, bool) else f"expected int, {got(v)}",
    "float": lambda v: None if is_number(v) else f"expected float, {got(v)}",  # an int fits (int defaults)
    "str": lambda v: None if isinstance(v, (str, os.PathLike)) else f"expected str, {got(v)}",
}
"""The checkers of the scalar kinds, by name; decoding asks them first whether a value is taken as it is."""


@functools.lru_cache(maxsize=None)
def checker_for(tp: Any) -> Checker:
    """A function (built once per annotation) that says why a value does not fit `tp`, or None."""
    kind, name, args = kind_of(tp), describe(tp), typing.get_args(tp)
    if kind in SCALAR_CHECKERS:
        return SCALAR_CHECKERS[kind]
    if kind == "union":
        arms = [checker_for(a) for a in args]

        def check_union(v: Any) -> Optional[str]:
            for arm in arms:
                if arm(v) is None:
                    return None
            return f"expected {name}, {got(v)}"

        return check_union
    if kind == "literal":
        allowed = [(type(a), a) for a in args]  # `1` is not `True`
        return lambda v: None if (type(v), v) in allowed else f"expected one of {list(args)}, got {v!r}"
    if kind == "enum":
        return lambda v: None if isinstance(v, tp) else f"expected {name} (one of {[m.name for m in tp]}), got {v!r}"
    if kind == "sequence":
        positional, item_type = item_types(tp)
        checks = [checker_for(a) for a in positional] if positional else None
        item = checker_for(item_type)
        accepted = (list, tuple, set, frozenset) if (typing.get_origin(tp) or tp) in (set, frozenset) else (list, tuple)

        def check_sequence(value: Any) -> Optional[str]:
            if not isinstance(value, accepted):
                return f"expected {name}, {got(value)}"
            if checks is not None and len(value) != len(checks):
                return f"expected {name} with {len(checks)} items, got {len(value)}"
            if checks is None and item is _ok:
                return None
            for check, v in zip(checks or itertools.repeat(item), value):
                why = check(v)
                if why:
                    return f"item {v!r}: {why}"
            return None

        return check_sequence
    if kind == "callable":
        return lambda v: None if callable(v) else f"expected a callable, {got(v)}"
    if kind == "mapping":
        key, value_of = (checker_for(a) for a in (args if len(args) == 2 else (Any, Any)))

        def check_mapping(value: Any) -> Optional[str]:
            if not isinstance(value, Mapping):
                return f"expected {name}, {got(value)}"
            if key is _ok and value_of is _ok:
                return None
            for k, v in value.items():
                why = key(k)
                if why:
                    return f"key {k!r}: {why}"
                why = value_of(v)
                if why:
                    return f"value of {k!r}: {why}"
            return None

        return check_mapping
    if kind != "any" and isinstance(tp, type):  # also a class not named above
        return lambda v: None if isinstance(v, tp) else f"expected {name}, {got(v)}"
    return _ok


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


def type_problem(cls: type, name: str, value: Any) -> Optional[str]:
    """Why `value` does not fit field `name` of `cls`, or None if it fits. None fits where the
    annotation allows it, and in a field whose default is None."""
    tp = field_types(cls).get(name)
    if tp is None:
        return None
    if value is not None:
        return checker_for(tp)(value)
    arms = typing.get_args(tp) if kind_of(tp) == "union" else (tp,)
    if type(None) in arms or tp in (Any, None) or cls.__dataclass_fields__[name].default is None:
        return None
    return f"expected {describe(tp)}, got None"


# ====================================================================== key paths below a field
@functools.lru_cache(maxsize=None)
def section_classes(tp: Any) -> tuple[type, ...]:
    """The concrete dataclasses a field declared as `tp` may hold (Optional/Union unpacked)."""
    return tuple(
        a for a in real_arms(tp) if isinstance(a, type) and dataclasses.is_dataclass(a) and not inspect.isabstract(a)
    )


_SECTIONS_BY_NAME: dict[type, Callable[[str], Any]] = {}
"""Section class -> what turns a name a field of that class may hold into the section."""


def register_section_names(cls: type, by_name: Callable[[str], Any]) -> None:
    """Fields declared as section `cls` may hold a name (a preset) for the section `by_name(name)`,
    which key paths below the field then address. Called by the module defining `cls`."""
    _SECTIONS_BY_NAME[cls] = by_name


def section_from_value(value: Any, tp: Any) -> Optional[Any]:
    """The dataclass section that key paths below a field address: the value itself, or the
    config a preset name stands for (`mixed_precision=bf16_mixed` then `mixed_precision.fp8=...`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value
    by_name = next((_SECTIONS_BY_NAME[c] for c in section_classes(tp) if c in _SECTIONS_BY_NAME), None)
    return by_name(value) if by_name is not None and isinstance(value, str) else None


def container_item_type(tp: Any, key: Any, kind: type) -> Optional[Any]:
    """The declared type of item `key` of a container of `kind` (dict, list or tuple) in a field
    declared as `tp`; Any when the declaration does not say, None when `tp` allows no such one."""
    for arm in real_arms(tp):
        arm_kind = kind_of(arm)
        if arm_kind == "any":
            return Any
        if (arm_kind == "mapping" and kind is dict) or (arm_kind == "sequence" and kind in (list, tuple)):
            positional, item = item_types(arm)
            if positional:
                return positional[key] if isinstance(key, int) and key < len(positional) else Any
            return item
    return None
