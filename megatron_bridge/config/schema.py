"""One compiled `FieldSpec` per config class and field: its type, default, docstring, range,
status and the checks its values go through. Decoding, validation, `--help-config`, the docs
table and the field catalog all read these.

Where the facts come from:
* type: the resolved annotation (`annotations.field_types`);
* default: the dataclass default, or the value of its factory, made once here;
* range (numbers and lists of numbers only): `field(range=...)` on the field in our classes, else
  `megatron_core_fields.RANGES` by `Class.field` of the megatron-core class that declares it;
  a class defined outside this package falls back to its type (finite floats, ints in [0, 2**63));
* status: `field(status=...)`, else `megatron_core_fields.STATUS`, else derived for `init=False`
  fields, else used (see `config.fields`).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_bridge.config import megatron_core_fields
from megatron_bridge.config.annotations import field_types, real_arms
from megatron_bridge.config.docstrings import field_docs
from megatron_bridge.config.fields import ANY, DERIVED, RANGE, STATUS, USED, Range, Unsupported, parse
from megatron_bridge.config.paths import is_path_field

NO_DEFAULT: Any = dataclasses.MISSING
"""The default of a required field."""

Status = typing.Union[str, Unsupported]

_INT = parse("[0, 2**63)")
_FLOAT = parse(ANY)


@dataclass(frozen=True, eq=False)
class FieldSpec:
    """Everything the config layer knows about field `name` of config class `cls`."""

    cls: type
    name: str
    type: Any
    init: bool
    owner: type
    """The class that declares the field: the first of our config classes, from the base down,
    that has it (for fields inherited from megatron-core, the first of ours that inherits them)."""
    core_owner: Optional[type]
    """The megatron-core dataclass that declares the field, if it comes from megatron-core."""
    numeric: Optional[type]
    """`int` or `float` for numbers (and lists of them), else None."""
    range: Optional[Range]
    status: Status
    is_path: bool
    """A path whose absence is None (checked by `config.paths`)."""

    @functools.cached_property
    def default(self) -> Any:
        """The class default (a factory's value, made once: for comparisons, never handed out),
        or NO_DEFAULT for a required field."""
        return _default_of(self.cls.__dataclass_fields__[self.name])

    @functools.cached_property
    def factory(self) -> Optional[Callable[[], Any]]:
        f = self.cls.__dataclass_fields__[self.name]
        return None if f.default_factory is dataclasses.MISSING else f.default_factory  # type: ignore[misc]

    def fresh_default(self) -> Any:
        """A new default value (a fresh object for default_factory fields)."""
        return self.factory() if self.factory is not None else self.default

    @functools.cached_property
    def core_default(self) -> Any:
        """megatron-core's default for a field it declares, else the class default."""
        if self.core_owner is None:
            return self.default
        return _default_of(_most_derived_core_field(self.cls, self.name))

    @property
    def required(self) -> bool:
        return self.default is NO_DEFAULT

    @property
    def doc(self) -> str:
        """The field's docstring (the most derived class that documents it wins)."""
        return field_docs(self.cls).get(self.name, "")

    @property
    def checks(self) -> tuple[str, ...]:
        """The value checks this field goes through when a config is validated (besides its type)."""
        found = []
        if self.range is not None:
            found.append(f"range {self.range}")
        if self.is_path:
            found.append("path")
        if isinstance(self.status, Unsupported) and self.status.needs is None:
            found.append("default only")
        return tuple(found)

    def status_text(self) -> str:
        """`used`, `derived`, or `unsupported: <reason>`."""
        if isinstance(self.status, Unsupported):
            return f"unsupported: {self.status.reason}"
        return self.status


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return NO_DEFAULT


def _most_derived_core_field(cls: type, name: str) -> dataclasses.Field:
    for klass in cls.__mro__:
        if _is_core(klass) and name in klass.__dict__.get("__dataclass_fields__", {}):
            return klass.__dataclass_fields__[name]
    raise KeyError(name)


def _is_ours(klass: type) -> bool:
    from megatron_bridge.config.base import ConfigBase

    return issubclass(klass, ConfigBase)


def _is_core(klass: type) -> bool:
    return not _is_ours(klass) and klass.__module__.startswith("megatron.") and dataclasses.is_dataclass(klass)


def numeric_kind(tp: Any) -> Optional[type]:
    """`int` or `float` if a field declared as `tp` holds numbers (or lists of them), else None."""
    if typing.get_origin(tp) in (list, tuple):
        arms = tuple(a for a in typing.get_args(tp) if a is not Ellipsis)
    else:
        arms = real_arms(tp)
    kinds = {numeric_kind(a) if typing.get_origin(a) in (list, tuple) else a for a in arms}
    return float if float in kinds else int if int in kinds else None


def _declared(cls: type, name: str, key: str) -> Any:
    """What `field(range=..., status=...)` says about `name`, from the most derived class that
    declares the field with it."""
    for klass in cls.__mro__:
        f = klass.__dict__.get("__dataclass_fields__", {}).get(name)
        if f is not None and key in f.metadata:
            return f.metadata[key]
    return None


def _compile(cls: type, name: str, tp: Any, f: dataclasses.Field) -> FieldSpec:
    mro = cls.__mro__
    owner = next((k for k in reversed(mro) if _is_ours(k) and name in k.__dict__.get("__dataclass_fields__", {})), cls)
    core = next((k for k in reversed(mro) if _is_core(k) and name in k.__dict__.get("__dataclass_fields__", {})), None)
    key = f"{core.__name__}.{name}" if core is not None else None
    numeric = numeric_kind(tp)
    rng = None
    if numeric is not None:
        rng = _declared(cls, name, RANGE)
        if rng is None and key in megatron_core_fields.RANGES:
            rng = parse(megatron_core_fields.RANGES[key])
        if rng is None:
            rng = _FLOAT if numeric is float else _INT
    status = _declared(cls, name, STATUS) or megatron_core_fields.STATUS.get(key)
    if status is None:
        status = USED if f.init else DERIVED
    return FieldSpec(cls, name, tp, f.init, owner, core, numeric, rng, status, is_path_field(name, tp, f))


@functools.lru_cache(maxsize=None)
def specs(cls: type) -> dict[str, FieldSpec]:
    """The `FieldSpec` of every field of dataclass `cls`, in declaration order."""
    fields = cls.__dataclass_fields__
    return {name: _compile(cls, name, tp, fields[name]) for name, tp in field_types(cls).items()}


def spec(cls: type, name: str) -> FieldSpec:
    return specs(cls)[name]


def undeclared_ranges(cls: type) -> list[str]:
    """Numeric fields of `cls` whose range comes from their type alone (no declaration)."""
    out = []
    for s in specs(cls).values():
        if s.numeric is None or _declared(cls, s.name, RANGE) is not None:
            continue
        if s.core_owner is None or f"{s.core_owner.__name__}.{s.name}" not in megatron_core_fields.RANGES:
            out.append(f"{s.owner.__name__}.{s.name}")
    return out
