"""Plain data to field values and back: `Decoder` turns plain data (from YAML, an override, a
recipe keyword) into the value a field declares, `Encoder` a value into plain data for YAML, in
the forms described in `config.annotations`.

Decoding also accepts what people type on a command line: `bf16` for a dtype, an enum member
name in any case, `silu` for `torch.nn.functional.silu`, numbers in quotes, a number where a
string is declared. Names (`_target_`, functions) resolve only through the registry of
`config.targets`, and decoding calls nothing but config-class constructors.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import numbers
import pathlib
import sys
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Iterable

from megatron_bridge.config import targets
from megatron_bridge.config.annotations import (
    ARGS,
    CALL,
    PARTIAL,
    PATH,
    SCALAR_CHECKERS,
    SEQUENCE_KINDS,
    TARGET,
    TUPLE,
    UNSERIALIZABLE,
    VALUE_TAGS,
    DecodeError,
    FlowList,
    checker_for,
    describe,
    got,
    is_number,
    is_value_tag,
    item_types,
    kind_of,
    real_arms,
    suggest,
    torch_dtype,
    values_equal,
)
from megatron_bridge.config.errors import show
from megatron_bridge.config.yaml_input import scalar

_PLAIN = (str, int, float, bool, type(None))
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64", "fp8": "float8_e4m3fn"}
_FIXES = {"bool": "use true or false", "int": "use a whole number, e.g. 8", "float": "use a number, e.g. 0.1 or 1e-4"}
_ENCODED_SEQUENCES = {list: list, Sequence: list, tuple: tuple, set: (set, frozenset), frozenset: (set, frozenset)}


# ====================================================================== decoding
class Decoder:
    """Turns plain data (from YAML or an override) into the value a field declares."""

    def section(self, raw: Mapping, declared: tuple[type, ...]) -> Any:
        """Decode a dataclass mapping; overridden by the serializer."""
        raise DecodeError("cannot build dataclasses here")

    def value(self, raw: Any, tp: Any = Any, lenient: bool = True) -> Any:  # noqa: C901 - one branch per kind
        """The value for a field declared as `tp`, or a DecodeError saying why not. Conversions (a
        number in quotes, a number for a string) only if `lenient`; a Union tries them last."""
        kind = kind_of(tp)
        scalar = SCALAR_CHECKERS.get(kind)
        if scalar is not None and scalar(raw) is None:
            return raw  # the common case first: a value of the declared scalar type as it is
        if raw is None:
            if kind in ("any", "none") or (kind == "union" and type(None) in typing.get_args(tp)):
                return None
            raise DecodeError(f"expected {describe(tp)}, got null", f"use a value of type {describe(tp)}")
        if kind == "any":
            return self.any(raw)
        if kind == "union":
            return self._union(raw, tp, lenient)
        if kind == "none":
            raise DecodeError(f"expected null, {got(raw)}", "remove the key")
        if _is_tagged(raw) and not (kind == "section" and TARGET in raw):
            return self._tagged(raw, tp)
        if scalar is not None:  # not of the type as it is: read it as a command line spells it
            value = _convert(tp, raw) if lenient else None
            if value is None:
                raise DecodeError(scalar(raw), _FIXES.get(kind, "quote the value"))
            return value
        origin = typing.get_origin(tp) or tp
        if kind == "literal":
            return _literal(typing.get_args(tp), raw, lenient)
        if kind == "dtype":
            return _dtype(raw)
        if kind == "enum":
            return _enum(origin, raw)
        if kind == "path":
            if not isinstance(raw, (str, origin)):
                raise DecodeError(f"expected a path, {got(raw)}", "use a string")
            return raw if isinstance(raw, origin) else origin(raw)
        if kind == "sequence":
            if isinstance(raw, (set, frozenset)) and origin in (set, frozenset):
                raw = list(raw)
            if not isinstance(raw, (list, tuple)):
                raise DecodeError(f"expected {describe(tp)}, {got(raw)}", "use a list, e.g. [a, b]")
            positional, item = item_types(tp)
            if positional is not None and len(raw) != len(positional):
                wrong = f"expected {len(positional)} items, got {len(raw)}: {show(raw)}"
                raise DecodeError(wrong, f"use {describe(tp)}")
            typed = enumerate(zip(positional or itertools.repeat(item), raw))
            return each(typed, lambda pair: self.value(pair[1], pair[0], lenient), SEQUENCE_KINDS[origin])
        if kind == "mapping":
            if not isinstance(raw, Mapping):
                raise DecodeError(f"expected a mapping, {got(raw)}", "use {key: value, ...}")
            item = item_types(tp)[1]
            return each(raw.items(), lambda v: self.value(v, item, lenient), dict)
        if kind == "callable":
            return self._function(raw)
        if kind == "section":
            if isinstance(raw, origin):
                return raw
            if isinstance(raw, Mapping):
                return self.section(raw, (origin,))
            if isinstance(raw, str) and raw.strip().lower() == getattr(origin, "config_name", None):
                return origin()  # a section selected by its short name (`peft=lora`), with its defaults
            raise DecodeError(f"expected a {origin.__name__} mapping, {got(raw)}", "use {field: value, ...}")
        return _checked(raw, tp)

    def import_path(self, path: Any) -> Any:
        """The registered object called `path`, as a DecodeError if there is none."""
        if not isinstance(path, str):
            raise DecodeError(f"_target_ must be a name string, {got(path)}", "e.g. 'torch.nn.init.normal_'")
        try:
            return targets.resolve(path)
        except targets.TargetNotAllowedError as exc:
            raise DecodeError(exc.message, exc.fix) from None

    def any(self, raw: Any) -> Any:
        """Decode data whose type the declaration does not give (honours the tags)."""
        if isinstance(raw, list):
            return each(enumerate(raw), self.any, list)
        if not isinstance(raw, Mapping):
            return raw
        if TARGET in raw:
            return self.instantiate(raw)
        tag, inner = next(iter(raw.items())) if is_value_tag(raw) else (None, None)
        if tag == TUPLE and isinstance(inner, list):
            return each(enumerate(inner), self.any, tuple)
        if tag == PATH and isinstance(inner, str):
            return pathlib.Path(inner)
        if tag == UNSERIALIZABLE:
            raise DecodeError(
                f"the saved value {inner} had no YAML form (a runtime object)",
                "delete this key to use the default, or set the value in Python after loading",
            )
        return each(raw.items(), self.any, dict)

    def instantiate(self, raw: Mapping) -> Any:
        """The object a `_target_` mapping describes: the object (`_call_: false`), a partial of a
        function (`_partial_: true`, plain arguments), a member of an enum (`_args_: [value]`, as
        NVIDIA Megatron Bridge writes them) or a config class; nothing else is called."""
        if raw.get(CALL) is False and raw[TARGET] in targets.REFERENCE_DEFAULTS:
            return None  # Megatron Bridge's name for what our None means
        obj = self.import_path(raw[TARGET])
        if raw.get(CALL) is False:
            extra = [k for k in raw if k not in (TARGET, CALL)]
            if extra:
                raise DecodeError(f"keys {extra} make no sense with _call_: false", "remove them")
            return obj
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            args = raw.get(ARGS)
            if set(raw) - {TARGET, CALL, ARGS} or not isinstance(args, list) or len(args) != 1:
                raise DecodeError(f"{raw[TARGET]!r} is an enum", "give its member as _args_: [value]")
            try:
                return obj(args[0])
            except ValueError:
                raise DecodeError(f"{args[0]!r} is not a value of {raw[TARGET]}", "use one of its values") from None
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

    def _tagged(self, raw: Mapping, tp: Any) -> Any:
        """A tagged mapping where a typed value was expected: decode it, then check its type."""
        value = self.any(raw)
        if isinstance(value, type) and any(kind_of(a) == "callable" for a in real_arms(tp)):
            raise DecodeError(f"{raw.get(TARGET)!r} is a class, not a function", "name a function")
        return _checked(value, tp)

    def _function(self, raw: Any) -> Any:
        if callable(raw):
            return raw
        if not isinstance(raw, str):
            raise DecodeError(f"expected a function, {got(raw)}", "use an import path such as torch.nn.functional.silu")
        obj = self.import_path(raw) if "." in raw else targets.resolve_short_callable(raw)
        if obj is None:
            hint = suggest(raw, targets.short_callable_names())
            where = " or ".join(targets.SHORT_NAME_NAMESPACES)
            raise DecodeError(f"no function {raw!r} in {where}", hint or "give its import path, e.g. mypkg.mod.fn")
        if not callable(obj) or isinstance(obj, type):
            raise DecodeError(f"{raw!r} is not a function", "name a function, e.g. torch.nn.functional.silu")
        return obj

    def _union(self, raw: Any, tp: Any, lenient: bool) -> Any:
        arms, classes, takes_dict = _union_plan(tp)
        if len(arms) == 1:
            return self.value(raw, arms[0], lenient)
        if classes and isinstance(raw, classes):
            return raw
        if classes and isinstance(raw, Mapping) and not is_value_tag(raw) and (TARGET in raw or not takes_dict):
            return self.section(raw, classes)
        if _is_tagged(raw):
            return self._tagged(raw, tp)  # decoded once: a _target_ call must not run per arm
        for mode in (False, True) if lenient else (False,):
            for arm in arms:
                try:
                    return self.value(raw, arm, mode)
                except DecodeError:
                    pass
        named = [c.config_name for c in classes if isinstance(getattr(c, "config_name", None), str)]
        if named and isinstance(raw, str):
            expected = f"expected {' or '.join(map(repr, named))} or a mapping, {got(raw)}"
            raise DecodeError(expected, suggest(raw, named) or f"use one of {named}")
        raise DecodeError(f"expected {describe(tp)}, {got(raw)}", f"use a value of type {describe(tp)}")


@functools.lru_cache(maxsize=None)
def _union_plan(tp: Any) -> tuple[tuple, tuple[type, ...], bool]:
    """(the arms other than None, the dataclass arms, whether a dict arm takes mappings) of Union `tp`."""
    arms = real_arms(tp)
    classes = tuple(a for a in arms if isinstance(a, type) and dataclasses.is_dataclass(a))
    return arms, classes, any(kind_of(a) == "mapping" for a in arms)


def each(items: Iterable[tuple[Any, Any]], decode: Callable[[Any], Any], kind: type) -> Any:
    """`kind` (list, tuple, dict, ...) of the decoded (key, raw) items; the problems of every item
    are raised together, each under its key."""
    out, errors = [], []
    for key, raw in items:
        try:
            out.append((key, decode(raw)))
        except DecodeError as exc:
            errors.extend(exc.under(key).items)
    if errors:
        raise DecodeError(items=errors)
    return dict(out) if kind is dict else kind(v for _, v in out)


def _check_plain(value: Any, where: str) -> None:
    """Arguments bound from a config are plain data: scalars, lists and mappings of them."""
    if isinstance(value, Mapping) and (TARGET in value or any(k in VALUE_TAGS for k in value)):
        raise DecodeError(f"{where} hold a tagged value {show(value)}", "function arguments must be plain data")
    if isinstance(value, (Mapping, list)):
        for v in value.values() if isinstance(value, Mapping) else value:
            _check_plain(v, where)
    elif type(value) not in _PLAIN:
        raise DecodeError(f"{where} hold {show(value)}", "function arguments must be plain data")


def _is_tagged(raw: Any) -> bool:
    if type(raw) in _PLAIN:  # the common case, without the Mapping check
        return False
    return isinstance(raw, Mapping) and (TARGET in raw or is_value_tag(raw))


def _convert(tp: type, raw: Any) -> Any:
    """`raw` read as scalar type `tp` the way a command line spells it (`"8"`, `"1e-4"`, `"true"`,
    a number for a string), or None."""
    if tp is str:
        return str(raw) if is_number(raw) else None
    if tp is int and isinstance(raw, float) and raw.is_integer():
        return int(raw)
    try:
        value = scalar(raw.strip()) if isinstance(raw, str) else None  # read as an override value is
    except ValueError:  # an integer of more digits than Python converts
        return None
    return tp(value) if value is not None and SCALAR_CHECKERS[tp.__name__](value) is None else None


def _literal(allowed: tuple, raw: Any, lenient: bool) -> Any:
    exact = [a for a in allowed if raw == a and type(raw) is type(a)]  # `1` is not `True`
    spelled = [a for a in allowed if str(a) == str(raw)] if lenient and (isinstance(raw, str) or is_number(raw)) else []
    if exact or spelled:
        return (exact or spelled)[0]
    hint = suggest(raw, allowed) if isinstance(raw, str) else ""
    raise DecodeError(f"expected one of {list(allowed)}, {got(raw)}", hint or f"use one of {list(allowed)}")


def _dtype(raw: Any) -> Any:
    if isinstance(raw, torch_dtype()):
        return raw
    if isinstance(raw, str):
        name = raw.strip().lower().removeprefix("torch.")
        found = getattr(sys.modules["torch"], _DTYPE_ALIASES.get(name, name), None) if name.isidentifier() else None
        if isinstance(found, torch_dtype()):
            return found
    raise DecodeError(f"expected a torch dtype, {got(raw)}", "use e.g. bfloat16, bf16, float16, fp16 or float32")


def _enum(cls: Any, raw: Any) -> Any:
    if isinstance(raw, cls):
        return raw
    if isinstance(raw, str):
        name = raw.strip().rsplit(".", 1)[-1]
        member = cls.__members__.get(name) or {n.lower(): m for n, m in cls.__members__.items()}.get(name.lower())
        if member is not None:
            return member
    elif not isinstance(raw, bool):
        try:
            return cls(raw)
        except (ValueError, TypeError):
            pass
    names = list(cls.__members__)
    hint = suggest(raw, names) if isinstance(raw, str) else ""
    raise DecodeError(f"expected {cls.__name__} (one of {names}), {got(raw)}", hint or f"use one of {names}")


def _checked(value: Any, tp: Any) -> Any:
    """`value` if it fits annotation `tp`, else a DecodeError saying why."""
    why = checker_for(tp)(value)
    if why:
        raise DecodeError(why, f"use a value of type {describe(tp)}")
    return value


# ====================================================================== encoding
class Encoder:
    """Turns config values into plain data (dicts, lists, scalars) for YAML."""

    def section(self, obj: Any) -> dict:
        """Encode a dataclass instance; overridden by the serializer (explicit-field tracking)."""
        raise NotImplementedError

    def value(self, value: Any, tp: Any = Any) -> Any:
        """Plain form of `value` for a field declared as `tp`: the readable form where `tp` says what
        the value is, a tagged mapping where it does not (`Any`, or another type than declared)."""
        if type(value) in _PLAIN:
            return value
        # Numbers, sections and partials describe themselves whatever the declaration.
        if isinstance(value, numbers.Real) and not isinstance(value, (enum.Enum, bool)):
            return int(value) if isinstance(value, numbers.Integral) else float(value)  # numpy scalars
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self.section(value)
        if isinstance(value, functools.partial):  # {_target_: func, _partial_: true, _args_: [...], **keywords}
            path = targets.name_of(value.func)
            if path is None:
                return {UNSERIALIZABLE: show(value)}
            out: dict[str, Any] = {TARGET: path, PARTIAL: True}
            if value.args:
                out[ARGS] = self._list(self.value(a) for a in value.args)
            out.update((k, self.value(v)) for k, v in value.keywords.items())
            return out
        kind = kind_of(tp)
        if kind == "union":
            arms = real_arms(tp)
            return self._union(value, tp, arms) if len(arms) != 1 else self.value(value, arms[0])
        origin = typing.get_origin(tp) or tp
        if kind == "enum" and isinstance(value, enum.Enum):
            return value.name
        if kind == "dtype" and isinstance(value, origin):
            return str(value).replace("torch.", "")
        if kind == "path" and isinstance(value, pathlib.PurePath):
            return str(value)
        if kind == "sequence" and isinstance(value, _ENCODED_SEQUENCES[origin]):
            positional, item = item_types(tp)
            typed = zip(value, positional if positional and len(positional) == len(value) else itertools.repeat(item))
            items = [self.value(v, a) for v, a in typed]
            return self._list(sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items)  # sets: stable
        if kind == "mapping" and isinstance(value, dict):
            item = item_types(tp)[1]
            return {k: self.value(v, item) for k, v in value.items()}
        if kind == "callable" or origin is type:
            path = targets.name_of(value)
            if path is not None:
                return path
        # The declaration does not say what the value is: the tagged forms.
        if type(value) is list:
            return self._list(self.value(v) for v in value)
        if type(value) is tuple:
            return {TUPLE: self._list(self.value(v) for v in value)}
        if type(value) is dict:
            return {k: self.value(v) for k, v in value.items()}
        if isinstance(value, pathlib.PurePath):
            return {PATH: str(value)}
        dtype = torch_dtype()
        if dtype is not None and isinstance(value, dtype):
            return {TARGET: str(value), CALL: False}
        path = targets.name_of(value) if isinstance(value, enum.Enum) or callable(value) else None
        return {UNSERIALIZABLE: show(value)} if path is None else {TARGET: path, CALL: False}

    def _union(self, value: Any, tp: Any, arms: tuple) -> Any:
        """The plain form for the first arm `value` fits, if it reads back as the same value;
        else the tagged form, which says what the value is."""
        arm = next((a for a in arms if checker_for(a)(value) is None), None)
        if arm is not None:
            plain = self.value(value, arm)
            try:
                if values_equal(_TRIAL_DECODER.value(plain, tp), value, strict=True):
                    return plain
            except DecodeError:
                pass
        return self.value(value)

    @staticmethod
    def _list(items: Iterable[Any]) -> list:
        out = list(items)
        return FlowList(out) if all(type(v) in _PLAIN for v in out) else out


_TRIAL_DECODER = Decoder()
"""Reads an encoding back to check it (builds no sections)."""
