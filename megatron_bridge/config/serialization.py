"""Configs to YAML and back, losslessly, with the record of which fields the user set.

Every dataclass section is written as a mapping with a `_target_` (its class's import path) and
every field; values use the readable forms described in `config.annotations`. Three optional keys carry the
explicit-field bookkeeping of `ConfigBase` (see base.py), so presets keep respecting the user's
choices after a reload:

* `_explicit_`: fields the user set whose value equals the class default (a user-set field with a
  non-default value is recognised by its value);
* `_implicit_`: fields whose value differs from the default although the user did not set them
  (a preset or a default the framework applied);
* `_derived_`: like `_implicit_`, but computed by `finalize()` from other fields; the next
  `finalize()` recomputes them, as it would have before saving.

Reading a section that has `_target_`: a field is the user's iff it is listed in `_explicit_`, or
its value differs from the default and it is not listed in `_implicit_`/`_derived_`. Reading a
hand-written section without `_target_`: every key present is the user's. Missing keys take the
class default; unknown keys are errors.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import re
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Optional, Union

import yaml

from megatron_bridge.config.annotations import (
    TARGET,
    UNSERIALIZABLE,
    VALUE_TAGS,
    DecodeError,
    Decoder,
    Encoder,
    FlowList,
    field_types,
    is_placeholder,
    section_classes,
    section_from_value,
    suggest,
)
from megatron_bridge.config.base import _DERIVED, _EXPLICIT, _MISSING, ConfigBase, values_equal
from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError, Problems, show
from megatron_bridge.config.targets import name_of as object_path
from megatron_bridge.config.targets import register_target, resolve

__all__ = [
    "from_dict",
    "from_yaml",
    "register_target",
    "resolve",
    "to_dict",
    "to_yaml",
]

logger = logging.getLogger(__name__)

EXPLICIT, IMPLICIT, DERIVED = "_explicit_", "_implicit_", "_derived_"
SECTION_TAGS = frozenset({TARGET, EXPLICIT, IMPLICIT, DERIVED})

_NO_DEFAULT = object()


# ====================================================================== class metadata
@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """What serialization needs to know about one dataclass field."""

    name: str
    init: bool
    type: Any
    default: Any  # _NO_DEFAULT when the field is required
    factory: Optional[Callable[[], Any]]

    @property
    def required(self) -> bool:
        """The field has no default (the constructor needs it)."""
        return self.default is _NO_DEFAULT

    def fresh_default(self) -> Any:
        """A new default value (a fresh object for default_factory fields)."""
        return self.factory() if self.factory is not None else self.default


@dataclasses.dataclass(frozen=True)
class ClassInfo:
    """Fields, aliases and import path of a dataclass, computed once per class."""

    cls: type
    fields: tuple[FieldInfo, ...]
    by_name: dict[str, FieldInfo]
    aliases: dict[str, str]
    tracked: bool

    @property
    def path(self) -> Optional[str]:
        """Import path of the class (None if it has none, e.g. a class defined in a function)."""
        return object_path(self.cls)

    def key_names(self) -> list[str]:
        """Every accepted key: field names and aliases."""
        return [*self.by_name, *self.aliases]


@functools.lru_cache(maxsize=None)
def class_info(cls: type) -> ClassInfo:
    """Cached `ClassInfo` of dataclass `cls`."""
    types = field_types(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default, factory = f.default, None
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            factory = f.default_factory  # type: ignore[misc]
            default = factory()  # kept for comparisons only; never handed out
        else:
            default, factory = _NO_DEFAULT, None
        fields.append(FieldInfo(f.name, f.init, types[f.name], default, factory))
    return ClassInfo(
        cls=cls,
        fields=tuple(fields),
        by_name={f.name: f for f in fields},
        aliases=dict(getattr(cls, "_field_aliases", {}) or {}),
        tracked=issubclass(cls, ConfigBase),
    )


def is_default(f: FieldInfo, value: Any) -> bool:
    """Whether `value` equals the class default of field `f` (a required field has none)."""
    return f.default is not _NO_DEFAULT and values_equal(value, f.default)


# ====================================================================== writing
class ConfigEncoder(Encoder):
    """`Encoder` that writes dataclass sections with `_target_` and the explicit-field tags."""

    def section(self, obj: Any) -> dict:
        info = class_info(type(obj))
        if info.path is None:
            return {UNSERIALIZABLE: show(obj)}
        tracked = isinstance(obj, ConfigBase)
        d = obj.__dict__
        explicit = d.get(_EXPLICIT, ()) if tracked else ()
        derived = d.get(_DERIVED, {}) if tracked else {}
        fields: dict[str, Any] = {}
        tags: dict[str, list[str]] = {EXPLICIT: [], IMPLICIT: [], DERIVED: []}
        for f in info.fields:
            value = getattr(obj, f.name, _NO_DEFAULT)
            if value is _NO_DEFAULT:  # an init=False field never set
                continue
            fields[f.name] = self.value(value, f.type)
            if not tracked:
                continue
            default = is_default(f, value)
            if f.name in explicit:
                if default:
                    tags[EXPLICIT].append(f.name)
            elif not default:
                # Only a value derived from the default can be recomputed from the saved file.
                before = derived.get(f.name, _NO_DEFAULT)
                recomputable = before is not _NO_DEFAULT and (before is _MISSING or is_default(f, before))
                tags[DERIVED if recomputable else IMPLICIT].append(f.name)
        out: dict[str, Any] = {TARGET: info.path}
        for tag, names in tags.items():
            if names:
                out[tag] = FlowList(sorted(names))
        out.update(fields)
        return out


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain nested data for a config (`_target_` class paths, readable values); see the module
    docstring. `from_dict` turns it back into an equal config."""
    return ConfigEncoder().value(obj)


class _YamlDumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # type: ignore[misc]
    pass


def _represent_float(dumper: Any, value: float) -> Any:
    """Floats at their shortest round-trip form (`1e-05`, `0.0003`), not PyYAML's `1.0e-05`; the
    config loader reads the exponent form back as a float."""
    if value != value:
        text = ".nan"
    elif value in (float("inf"), float("-inf")):
        text = ".inf" if value > 0 else "-.inf"
    else:
        text = repr(value)
    return dumper.represent_scalar("tag:yaml.org,2002:float", text)


_YamlDumper.add_representer(float, _represent_float)
# ...and so writes them untagged, as it reads them.
_YamlDumper.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)
_YamlDumper.add_representer(
    FlowList, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)


def to_yaml(obj: Any, path: Optional[Union[str, os.PathLike]] = None) -> str:
    """YAML text of a config; also written to `path` (parent directories created) when given."""
    text = yaml.dump(
        to_dict(obj), Dumper=_YamlDumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=10000
    )
    if path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    return text


# ====================================================================== reading
class ConfigDecoder(Decoder):
    """`Decoder` that builds dataclass sections (`build_section`) or merges mappings into existing
    ones (`merge`): the one reader of config mappings, whatever their source."""

    def section(self, raw: Mapping, declared: tuple[type, ...]) -> Any:
        cls = self.section_class(raw, declared)
        return build_section(self, cls, raw)

    def field(self, f: FieldInfo, raw: Any, current: Any = _NO_DEFAULT) -> Any:
        """The new value of field `f` from plain data. Given the `current` value, a plain mapping
        merges into it (a section, or a dict) instead of replacing it."""
        if current is not _NO_DEFAULT and isinstance(raw, Mapping) and not (len(raw) == 1 and next(iter(raw)) in VALUE_TAGS):
            classes = section_classes(f.type)
            if classes:
                try:
                    section = section_from_value(current, f.type)
                except ConfigValidationError as exc:
                    raise DecodeError(items=[("", p.message, p.fix) for p in exc.problems]) from None
                return self.section(raw, classes) if section is None else self.merge(section, raw)
            if isinstance(current, dict) and TARGET not in raw:
                return merge_dicts(current, decode_field(self, f, raw))
        return decode_field(self, f, raw)

    def merge(self, obj: Any, raw: Mapping) -> Any:
        """Merge section mapping `raw` into dataclass `obj`; returns `obj`, or a new section when
        `raw` has a `_target_` naming another class. Fields that decode are set even when others
        do not; the problems are then raised together as one DecodeError."""
        if TARGET in raw:
            cls = self.section_class(raw, ())
            if cls is not type(obj):
                return self.section(raw, (cls,))
        info = class_info(type(obj))
        tags, values, errors = read_section(self, info, raw, obj)
        from_dump, tracked = TARGET in raw, isinstance(obj, ConfigBase)
        for name, value in values.items():
            try:
                if not (value is getattr(obj, name, None) and dataclasses.is_dataclass(value)):  # merged in place
                    setattr(obj, name, value)  # type-checked; marks the field as the user's
            except (TypeError, ValueError) as exc:
                errors.append((name, str(exc), "use a value of the declared type"))
                continue
            if from_dump and tracked:  # a saved section: whether the user set it follows the file
                f = info.by_name[name]
                obj.mark_explicit(name, name in tags[EXPLICIT] or (name not in tags[IMPLICIT] | tags[DERIVED] and not is_default(f, value)))
                if name in tags[DERIVED]:
                    remember_derived(obj, name, f.fresh_default())
        if errors:
            raise DecodeError(items=errors)
        return obj

    def section_class(self, raw: Mapping, declared: tuple[type, ...]) -> type:
        """The class a section mapping describes: its `_target_`, or the declared class whose
        fields cover its keys."""
        names = " or ".join(c.__name__ for c in declared)
        if TARGET in raw:
            try:
                cls = self.import_path(raw[TARGET])
            except DecodeError as exc:
                raise DecodeError(items=[("", f"_target_: {m}", f) for _, m, f in exc.items]) from None
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                raise DecodeError(f"_target_ {raw[TARGET]!r} is not a config dataclass", "name a config class")
            if declared and not issubclass(cls, declared):
                raise DecodeError(f"_target_ {raw[TARGET]!r} is not a {names}", f"name a subclass of {names}")
            return cls
        if not declared:
            raise DecodeError("no _target_ says which config class this is", "add _target_ or pass cls=")
        # The concrete class that knows the most keys; build_section reports the keys it does not.
        keys = [k for k in raw if k not in SECTION_TAGS]
        best, best_unknown = None, None
        for cls in declared:
            if inspect.isabstract(cls):
                continue
            info = class_info(cls)
            unknown = sum(1 for k in keys if k not in info.by_name and k not in info.aliases)
            if best_unknown is None or unknown < best_unknown:
                best, best_unknown = cls, unknown
        if best is None:
            raise DecodeError(f"cannot tell which {names} this is", "add _target_ with the class's import path")
        return best


def tag_names(info: ClassInfo, raw: Mapping, tag: str) -> tuple[set[str], list[tuple[str, str, str]]]:
    """Field names listed under `tag` in a section mapping, and problems with the list."""
    names = raw.get(tag)
    if names is None:
        return set(), []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return set(), [(tag, f"must be a list of field names, got {show(names)}", "e.g. [num_layers]")]
    out, errors = set(), []
    for n in names:
        name = info.aliases.get(n, n)
        if name in info.by_name:
            out.add(name)
        else:
            hint = suggest(n, info.key_names())
            errors.append((tag, f"{n!r} is not a field of {info.cls.__name__}", hint or "remove it"))
    return out, errors


def read_section(
    loader: ConfigDecoder, info: ClassInfo, raw: Mapping, current: Any = None
) -> tuple[dict[str, set[str]], dict[str, Any], list]:
    """Read a section mapping: (its bookkeeping tags, {field name: new value}, problems).

    With `current` (the section being merged into), a plain mapping merges into the field's value.
    A runtime object the framework installed (a placeholder in an `_implicit_`/`_derived_` field,
    e.g. the loss-scaling hook of a saved run) is left out, so the field keeps its default and
    the framework installs it again; a user's value without a YAML form is an error."""
    tags: dict[str, set[str]] = {}
    errors: list[tuple[str, str, str]] = []
    for tag in (EXPLICIT, IMPLICIT, DERIVED):
        tags[tag], tag_errors = tag_names(info, raw, tag)
        errors.extend(tag_errors)
    not_users = tags[IMPLICIT] | tags[DERIVED]
    values: dict[str, Any] = {}
    for key, item in raw.items():
        if key in SECTION_TAGS:
            continue
        name = info.aliases.get(key, key) if isinstance(key, str) else key
        f = info.by_name.get(name)
        if f is None:
            errors.append((str(key), *unknown_key(info, key)))
            continue
        if name in values:
            errors.append((str(key), f"{name!r} is given twice (once through an alias)", "keep one"))
            continue
        if name in not_users and is_placeholder(item):
            logger.info("%s.%s: the saved run had a runtime object here; using the default", info.cls.__name__, name)
            continue
        try:
            values[name] = loader.field(f, item, _NO_DEFAULT if current is None else getattr(current, name, None))
        except DecodeError as exc:
            errors.extend(exc.under(key).items)
    return tags, values, errors


def unknown_key(info: ClassInfo, key: Any) -> tuple[str, str]:
    """(message, fix) for a key that is not a field of the section."""
    return f"unknown key: {info.cls.__name__} has no field {key!r}", suggest(key, info.key_names()) or "remove it"


def merge_dicts(base: dict, update: Mapping) -> dict:
    """OmegaConf-style merge: nested dicts merge, everything else is replaced."""
    out = dict(base)
    for k, v in update.items():
        out[k] = merge_dicts(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def decode_field(loader: Decoder, f: FieldInfo, raw: Any) -> Any:
    """The value of field `f` from plain data. None is accepted where the default is None even
    if the annotation does not say Optional (as megatron-core declares many fields)."""
    if raw is None and f.default is None:
        return None
    return loader.value(raw, f.type)


def build_section(loader: Decoder, cls: type, raw: Mapping) -> Any:
    """Build an instance of dataclass `cls` from a section mapping (see the module docstring)."""
    info = class_info(cls)
    tags, values, errors = read_section(loader, info, raw)
    present = {info.aliases.get(k, k) for k in raw if k not in SECTION_TAGS}
    for f in info.fields:
        if f.required and f.init and f.name not in present:
            errors.append((f.name, f"is required by {cls.__name__} but missing", f"add {f.name}"))
    if errors:
        raise DecodeError(items=errors)
    try:
        obj = cls(**{n: v for n, v in values.items() if info.by_name[n].init})
    except (TypeError, ValueError, AssertionError) as exc:
        raise DecodeError(f"cannot build {cls.__name__}: {exc}", "fix the fields it names") from None
    for name, value in values.items():
        if not info.by_name[name].init:
            object.__setattr__(obj, name, value)
    if info.tracked:
        restore_tracking(obj, info, present, tags, from_dump=TARGET in raw)
    return obj


def restore_tracking(obj: Any, info: ClassInfo, present: Iterable[str], tags: dict, from_dump: bool) -> None:
    """Set which fields of a freshly loaded `obj` count as the user's (module docstring rule),
    and remember the `_derived_` ones for the next finalize."""
    not_users = tags.get(IMPLICIT, set()) | tags.get(DERIVED, set())
    if from_dump:
        explicit = set(tags.get(EXPLICIT, ()))
        for f in info.fields:
            if f.name not in explicit and f.name not in not_users and not is_default(f, getattr(obj, f.name, None)):
                explicit.add(f.name)
    else:
        explicit = (set(present) | tags.get(EXPLICIT, set())) - not_users
    obj.__dict__[_EXPLICIT] = explicit
    for name in tags.get(DERIVED, ()):
        remember_derived(obj, name, info.by_name[name].fresh_default())


def remember_derived(obj: ConfigBase, name: str, before: Any) -> None:
    """Record that finalize computed `name` from `before`, so the next finalize puts `before`
    back and recomputes it (as `ConfigBase._derive` does)."""
    obj.__dict__.setdefault(_DERIVED, {})[name] = before


def raise_decode_error(exc: DecodeError, source: str = "") -> None:
    """Raise a `DecodeError` as one `ConfigValidationError` with dotted paths, each message
    tagged with `source` (as `config.apply` tags them)."""
    problems = Problems()
    for path, message, fix in exc.items:
        problems.add(path, f"{message} [{source}]" if source else message, fix)
    problems.raise_if_any()


def from_dict(data: Mapping, cls: Optional[type] = None, source: str = "") -> Any:
    """Build a config from `to_dict` output or a hand-written equivalent.

    `cls` is the expected class (the data's `_target_` may name a subclass); without it the data
    must carry `_target_`. Names resolve through `config.targets` only. All problems are raised
    together as one `ConfigValidationError`, tagged with `source` (e.g. `file my.yaml`) if given.
    """
    if not isinstance(data, Mapping):
        raise ConfigValidationError(ConfigProblem("", f"expected a mapping of sections, got {show(data)}"))
    loader = ConfigDecoder()
    try:
        return loader.section(data, (cls,) if cls is not None else ())
    except DecodeError as exc:
        raise_decode_error(exc, source)


def load_yaml_file(path: Union[str, os.PathLike]) -> Any:
    """Parse a config file (bounded; see `config.yaml_input`); a missing file is
    FileNotFoundError, anything else wrong a ConfigValidationError naming the file."""
    from megatron_bridge.config.yaml_input import load_file

    return load_file(path)


def from_yaml(path: Union[str, os.PathLike], cls: Optional[type] = None) -> Any:
    """Load a config from a YAML file written by `to_yaml` (or by hand); see `from_dict`."""
    data = load_yaml_file(path)
    if data is None:
        raise ConfigValidationError(ConfigProblem("", f"{os.fspath(path)} is empty", "write the config into it"))
    return from_dict(data, cls, f"file {os.fspath(path)}")
