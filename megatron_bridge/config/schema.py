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
import re
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from megatron_bridge.config import megatron_core_fields
from megatron_bridge.config.annotations import field_types, real_arms
from megatron_bridge.config.docstrings import field_docs
from megatron_bridge.config.fields import ANY, DERIVED, RANGE, STATUS, USED, Range, Unsupported, parse

_PATH_NAME = re.compile(r"(^|_)(dir|directory|logdir|path|filepath|save|load|checkpoint|uri)$")
"""Names of the fields that hold a path (checked by `config.paths`) when None is their default."""

CONFIG_BASE: Optional[type] = None
"""`config.base.ConfigBase`, which registers itself here (it imports this module)."""

NO_DEFAULT: Any = dataclasses.MISSING
"""The default of a required field."""

Status = typing.Union[str, Unsupported]

_INT = parse("[0, 2**63)")
_FLOAT = parse(ANY)


@dataclass(eq=False)
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
    """The numbers allowed (each item, for lists); None for other fields."""
    status: Status
    """`used`, `derived`, or an `Unsupported` with its reason."""
    is_path: bool
    """A path whose absence is None (checked by `config.paths`)."""

    @functools.cached_property
    def default(self) -> Any:
        """The class default (a factory's value, made once: for comparisons, never handed out),
        or NO_DEFAULT for a required field."""
        return _default_of(self.cls.__dataclass_fields__[self.name])

    def fresh_default(self) -> Any:
        """A new default value (a fresh object for default_factory fields)."""
        factory = self.cls.__dataclass_fields__[self.name].default_factory
        return self.default if factory is dataclasses.MISSING else factory()  # type: ignore[misc]

    @functools.cached_property
    def core_default(self) -> Any:
        """megatron-core's default for a field it declares (in the most derived megatron-core class
        that has it), else the class default."""
        for klass in self.cls.__mro__:
            if _is_core(klass) and self.name in vars(klass).get("__dataclass_fields__", {}):
                return _default_of(klass.__dataclass_fields__[self.name])
        return self.default

    @property
    def required(self) -> bool:
        return self.default is NO_DEFAULT

    @property
    def doc(self) -> str:
        """The field's docstring (the most derived class that documents it wins)."""
        return field_docs(self.cls).get(self.name, "")

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


def _is_ours(klass: type) -> bool:
    return CONFIG_BASE is not None and issubclass(klass, CONFIG_BASE)


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


class ClassSpecs(Mapping):
    """The `FieldSpec` of every field of a dataclass, by name, in declaration order. A field's spec
    is compiled when first asked for: an override touches a few of the hundreds of fields a model
    config has, validation all of them."""

    def __init__(self, cls: type):
        self.cls = cls
        self.types = field_types(cls)
        self.owner: dict[str, type] = {}  # the first of our classes, from the base down, that has the field
        self.core: dict[str, type] = {}  # the first megatron-core dataclass, from the base down, that has it
        self.declared: dict[str, dict[str, Any]] = {RANGE: {}, STATUS: {}}  # the most derived declaration wins
        for klass in reversed(cls.__mro__):
            fields = klass.__dict__.get("__dataclass_fields__")
            if not fields:
                continue
            first = self.owner if _is_ours(klass) else self.core if _is_core(klass) else None
            for name, f in fields.items():
                if first is not None:
                    first.setdefault(name, klass)
                for key, found in self.declared.items():
                    if key in f.metadata:
                        found[name] = f.metadata[key]
        self.made: dict[str, FieldSpec] = {}

    def __getitem__(self, name: str) -> FieldSpec:
        made = self.made.get(name)
        if made is None:
            made = self.made[name] = self._compile(name, self.types[name])
        return made

    def __iter__(self) -> Iterator[str]:
        return iter(self.types)

    def __len__(self) -> int:
        return len(self.types)

    def _compile(self, name: str, tp: Any) -> FieldSpec:
        f = self.cls.__dataclass_fields__[name]
        core = self.core.get(name)
        key = f"{core.__name__}.{name}" if core is not None else None
        numeric = numeric_kind(tp)
        rng = None
        if numeric is not None:
            declared = self.declared[RANGE].get(name) or megatron_core_fields.RANGES.get(key)
            rng = declared or (_FLOAT if numeric is float else _INT)
        status = self.declared[STATUS].get(name) or megatron_core_fields.STATUS.get(key) or (USED if f.init else DERIVED)
        path = bool(_PATH_NAME.search(name)) and str in real_arms(tp) and f.default is None
        return FieldSpec(self.cls, name, tp, f.init, self.owner.get(name, self.cls), core, numeric, rng, status, path)


@functools.lru_cache(maxsize=None)
def specs(cls: type) -> ClassSpecs:
    """The `FieldSpec` of every field of dataclass `cls`, by name, in declaration order."""
    return ClassSpecs(cls)


def undeclared_ranges(cls: type) -> list[str]:
    """Numeric fields of `cls` whose range comes from their type alone (no declaration)."""
    return [f"{s.owner.__name__}.{s.name}" for s in specs(cls).values() if s.range is _INT or s.range is _FLOAT]
