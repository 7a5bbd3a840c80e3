"""Plain data (from YAML, an override, a recipe keyword) to the value a field declares.

Decoding also accepts what people type on a command line: `bf16` for a dtype, an enum member
name in any case, `silu` for `torch.nn.functional.silu`, numbers in quotes, a number where a
string is declared. The tagged mappings of `config.annotations` are honoured. Names (`_target_`,
functions) resolve only through the registry of `config.targets`, and decoding calls nothing but
config-class constructors. One decoder is built per annotation, when a value for it first comes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import pathlib
import re
import typing
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Literal

from megatron_bridge.config.annotations import (
    ARGS,
    CALL,
    PARTIAL,
    PATH,
    SEQUENCE_KINDS,
    TARGET,
    TUPLE,
    UNSERIALIZABLE,
    VALUE_TAGS,
    DecodeError,
    checker_for,
    describe,
    got,
    is_callable_type,
    is_number,
    kind_of,
    is_value_tag,
    real_arms,
    sequence_items,
    suggest,
    torch_dtype,
    union_arms,
)
from megatron_bridge.config import targets
from megatron_bridge.config.errors import show

# A decoder reads `raw` for one annotation: decode(decoder, raw, lenient) -> value, or DecodeError.
# `lenient` allows conversions (a number in quotes); a Union tries them after every arm refused.
Decode = Callable[["Decoder", Any, bool], Any]

_INT_RE = re.compile(r"[-+]?\d+")
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)", re.IGNORECASE)


@functools.lru_cache(maxsize=None)
def dtype_aliases() -> dict[str, Any]:
    """Short dtype spellings (`bf16`, `fp32`, ...); only asked for once torch is imported."""
    import torch

    aliases = {"bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16, "fp32": torch.float32}
    aliases.update(float=torch.float32, fp64=torch.float64, double=torch.float64)
    if hasattr(torch, "float8_e4m3fn"):
        aliases["fp8"] = torch.float8_e4m3fn
    return aliases


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
        return decoder_for(tp)(self, raw, True)

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
    if isinstance(value, Mapping):
        if TARGET in value or any(k in VALUE_TAGS for k in value):
            raise DecodeError(f"{where} hold a tagged value {show(value)}", "function arguments must be plain data")
        for v in value.values():
            _check_plain(v, where)
    elif isinstance(value, list):
        for v in value:
            _check_plain(v, where)
    elif not (value is None or type(value) in (str, int, float, bool)):
        raise DecodeError(f"{where} hold {show(value)}", "function arguments must be plain data")


def _is_tagged(raw: Any) -> bool:
    return isinstance(raw, Mapping) and (TARGET in raw or is_value_tag(raw))


def _tagged(dc: Decoder, raw: Any, tp: Any) -> Any:
    """A tagged mapping where a typed value was expected: decode it, then check its type."""
    value = dc.any(raw)
    if isinstance(value, type) and any(is_callable_type(a) for a in (union_arms(tp) or (tp,))):
        raise DecodeError(f"{raw.get(TARGET)!r} is a class, not a function", "name a function")
    why = checker_for(tp)(value)
    if why:
        raise DecodeError(why, f"use a value of type {describe(tp)}")
    return value


@functools.lru_cache(maxsize=None)
def decoder_for(tp: Any) -> Decode:
    """The decoder of annotation `tp`, built once."""
    try:
        return _build_decoder(tp)
    except TypeError:  # an exotic annotation: read it untyped
        return lambda dc, raw, lenient: dc.any(raw)


def _build_decoder(tp: Any) -> Decode:
    kind = kind_of(tp)
    if kind == "any":
        return lambda dc, raw, lenient: dc.any(raw)
    if kind == "none":

        def none(dc: Decoder, raw: Any, lenient: bool) -> None:
            if raw is not None:
                raise DecodeError(f"expected null, {got(raw)}", "remove the key")

        return none
    if kind == "union":
        return _union_decoder(tp)
    read, fix = _typed_reader(tp, kind), f"use a value of type {describe(tp)}"

    def decode(dc: Decoder, raw: Any, lenient: bool) -> Any:
        """None is refused; tagged mappings are decoded, then type-checked."""
        if raw is None:
            raise DecodeError(f"expected {describe(tp)}, got null", fix)
        if _is_tagged(raw) and not (kind == "section" and TARGET in raw):
            return _tagged(dc, raw, tp)
        return read(dc, raw, lenient)

    return decode


_SCALARS: dict[type, tuple[Callable[[Any], bool], str]] = {  # type -> (accepts a value as it is, fix)
    bool: (lambda raw: isinstance(raw, bool), "use true or false"),
    int: (lambda raw: isinstance(raw, int) and not isinstance(raw, bool), "use a whole number, e.g. 8"),
    float: (is_number, "use a number, e.g. 0.1 or 1e-4"),  # an int stays an int (float fields with int defaults)
    str: (lambda raw: isinstance(raw, str), "quote the value"),
}


def _convert(tp: type, raw: Any) -> Any:
    """`raw` read as scalar type `tp` the way a command line spells it (`"8"`, `"1e-4"`, `"true"`,
    a number for a string), or None."""
    if tp is str:
        return str(raw) if is_number(raw) else None
    if tp is int and isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if not isinstance(raw, str):
        return None
    if tp is bool:
        return raw.lower() == "true" if raw.lower() in ("true", "false") else None
    return tp(raw) if (_INT_RE if tp is int else _FLOAT_RE).fullmatch(raw.strip()) else None


def _scalar_decoder(tp: type) -> Decode:
    fits, fix = _SCALARS[tp]

    def scalar(dc: Decoder, raw: Any, lenient: bool) -> Any:
        if fits(raw):
            return raw
        value = _convert(tp, raw) if lenient else None
        if value is None:
            raise DecodeError(f"expected {tp.__name__}, {got(raw)}", fix)
        return value

    return scalar


def _typed_reader(tp: Any, kind: str) -> Decode:
    """The decoder of a non-None value for annotation `tp` of `kind` (not a Union)."""
    origin, args = typing.get_origin(tp) or tp, typing.get_args(tp)
    if kind == "literal":
        return _literal_decoder(args)
    if kind in ("bool", "int", "float", "str"):
        return _scalar_decoder(tp)
    if kind == "dtype":
        return _dtype
    if kind == "enum":
        return _enum_decoder(origin)
    if kind == "path":

        def path(dc: Decoder, raw: Any, lenient: bool) -> Any:
            if isinstance(raw, origin):
                return raw
            if isinstance(raw, str):
                return origin(raw)
            raise DecodeError(f"expected a path, {got(raw)}", "use a string")

        return path
    if kind == "sequence":
        return _sequence_decoder(tp, origin)
    if kind == "mapping":
        item = decoder_for(args[1] if len(args) == 2 else Any)

        def mapping(dc: Decoder, raw: Any, lenient: bool) -> dict:
            if not isinstance(raw, Mapping):
                raise DecodeError(f"expected a mapping, {got(raw)}", "use {key: value, ...}")
            return each(raw.items(), lambda v: item(dc, v, lenient), dict)

        return mapping
    if kind == "callable":
        return _function
    if kind == "section":

        def section(dc: Decoder, raw: Any, lenient: bool) -> Any:
            if isinstance(raw, origin):
                return raw
            if isinstance(raw, Mapping):
                return dc.section(raw, (origin,))
            if isinstance(raw, str) and raw.strip().lower() == getattr(origin, "config_name", None):
                return origin()  # a section selected by its short name (`peft=lora`), with its defaults
            raise DecodeError(f"expected a {origin.__name__} mapping, {got(raw)}", "use {field: value, ...}")

        return section
    check = checker_for(tp)

    def other(dc: Decoder, raw: Any, lenient: bool) -> Any:
        why = check(raw)
        if why:
            raise DecodeError(why, f"use a value of type {describe(tp)}")
        return raw

    return other


def _literal_decoder(allowed: tuple) -> Decode:
    def literal(dc: Decoder, raw: Any, lenient: bool) -> Any:
        for a in allowed:
            if raw == a and type(raw) is type(a):
                return a
        if lenient and isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            for a in allowed:
                if str(a) == str(raw):
                    return a
        hint = suggest(raw, allowed) if isinstance(raw, str) else ""
        raise DecodeError(f"expected one of {list(allowed)}, {got(raw)}", hint or f"use one of {list(allowed)}")

    return literal


def _dtype(dc: Decoder, raw: Any, lenient: bool) -> Any:
    dtype = torch_dtype()
    if isinstance(raw, dtype):
        return raw
    if isinstance(raw, str):
        import torch

        name = raw.strip().lower().removeprefix("torch.")
        found = dtype_aliases().get(name, getattr(torch, name, None) if name.isidentifier() else None)
        if isinstance(found, dtype):
            return found
    raise DecodeError(f"expected a torch dtype, {got(raw)}", "use e.g. bfloat16, bf16, float16, fp16 or float32")


def _function(dc: Decoder, raw: Any, lenient: bool) -> Any:
    if isinstance(raw, str):
        obj = dc.import_path(raw) if "." in raw else targets.resolve_short_callable(raw)
        if obj is None:
            hint = suggest(raw, targets.short_callable_names())
            where = " or ".join(targets.SHORT_NAME_NAMESPACES)
            raise DecodeError(f"no function {raw!r} in {where}", hint or "give its import path, e.g. mypkg.mod.fn")
        if callable(obj) and not isinstance(obj, type):
            return obj
        raise DecodeError(f"{raw!r} is not a function", "name a function, e.g. torch.nn.functional.silu")
    if callable(raw):
        return raw
    raise DecodeError(f"expected a function, {got(raw)}", "use an import path such as torch.nn.functional.silu")


def _enum_decoder(cls: type) -> Decode:
    names = list(cls.__members__)
    folded = {n.lower(): m for n, m in cls.__members__.items()}

    def decode(dc: Decoder, raw: Any, lenient: bool) -> Any:
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


def _sequence_decoder(tp: Any, origin: Any) -> Decode:
    positional, item_type = sequence_items(tp)
    per_item = [decoder_for(a) for a in positional] if positional else None
    item = decoder_for(item_type)

    def decode(dc: Decoder, raw: Any, lenient: bool) -> Any:
        if not isinstance(raw, (list, tuple)):
            raise DecodeError(f"expected {describe(tp)}, {got(raw)}", "use a list, e.g. [a, b]")
        if per_item is None:
            return each(enumerate(raw), lambda v: item(dc, v, lenient), SEQUENCE_KINDS[origin])
        if len(raw) != len(per_item):
            raise DecodeError(f"expected {len(per_item)} items, got {len(raw)}: {show(raw)}", f"use {describe(tp)}")
        return each(enumerate(zip(per_item, raw)), lambda pair: pair[0](dc, pair[1], lenient), tuple)

    return decode


def _union_decoder(tp: Any) -> Decode:
    none_ok = type(None) in union_arms(tp)
    real = real_arms(tp)
    if len(real) == 1:
        single = decoder_for(real[0])
        return (lambda dc, raw, lenient: None if raw is None else single(dc, raw, lenient)) if none_ok else single
    decoders = [decoder_for(a) for a in real]
    classes = tuple(a for a in real if isinstance(a, type) and dataclasses.is_dataclass(a))
    takes_dict = any(kind_of(a) == "mapping" for a in real)
    named = [c.config_name for c in classes if isinstance(getattr(c, "config_name", None), str)]
    fix = f"use a value of type {describe(tp)}"

    def decode(dc: Decoder, raw: Any, lenient: bool) -> Any:
        if raw is None:
            if none_ok:
                return None
            raise DecodeError(f"expected {describe(tp)}, got null", fix)
        if classes and isinstance(raw, classes):
            return raw
        if classes and isinstance(raw, Mapping) and not is_value_tag(raw) and (TARGET in raw or not takes_dict):
            return dc.section(raw, classes)
        if _is_tagged(raw):
            return _tagged(dc, raw, tp)  # decoded once: a _target_ call must not run per arm
        for mode in (False, True) if lenient else (False,):
            for decoder in decoders:
                try:
                    return decoder(dc, raw, mode)
                except DecodeError:
                    pass
        if named and isinstance(raw, str):
            hint = suggest(raw, named)
            raise DecodeError(f"expected {' or '.join(map(repr, named))} or a mapping, {got(raw)}", hint or f"use one of {named}")
        raise DecodeError(f"expected {describe(tp)}, {got(raw)}", fix)

    return decode
