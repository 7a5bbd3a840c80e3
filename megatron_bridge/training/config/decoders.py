"""Plain data (from YAML or an override) to config values, guided by the declared type.

See `codecs` for the forms; decoding also accepts what people type on a command line: `bf16`
for a dtype, an enum member name in any case, `silu` for `torch.nn.functional.silu`, numbers in
quotes, a number where a string is declared.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import pathlib
import re
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from megatron_bridge.config.errors import show
from megatron_bridge.config.typecheck import checker_for, describe
from megatron_bridge.training.config.codecs import (
    ARGS,
    CALL,
    PARTIAL,
    PATH,
    TARGET,
    TUPLE,
    UNSERIALIZABLE,
    VALUE_TAGS,
    DecodeError,
    got,
    is_any,
    is_callable_type,
    suggest,
    union_arms,
)
from megatron_bridge.config.targets import (
    SHORT_NAME_NAMESPACES,
    TargetNotAllowedError,
    resolve,
    resolve_short_callable,
    short_callable_names,
)

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
