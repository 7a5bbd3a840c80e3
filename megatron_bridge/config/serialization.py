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
from collections.abc import Mapping
from typing import Any, Optional, Union

import yaml

from megatron_bridge.config.annotations import (
    TARGET,
    UNSERIALIZABLE,
    DecodeError,
    FlowList,
    is_value_tag,
    real_arms,
    section_classes,
    section_from_value,
    suggest,
)
from megatron_bridge.config.base import _DERIVED, _EXPLICIT, _MISSING, is_config, values_equal
from megatron_bridge.config.codec import Decoder, Encoder
from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError, Problems, show
from megatron_bridge.config.schema import FieldSpec, specs
from megatron_bridge.config.secrets import conceal
from megatron_bridge.config.targets import name_of, register_target, resolve
from megatron_bridge.config.yaml_input import load_file, read_exponent_floats

__all__ = ["from_dict", "from_yaml", "register_target", "resolve", "to_dict", "to_yaml"]

logger = logging.getLogger(__name__)

EXPLICIT, IMPLICIT, DERIVED = "_explicit_", "_implicit_", "_derived_"
SECTION_TAGS = frozenset({TARGET, EXPLICIT, IMPLICIT, DERIVED})

_NO_DEFAULT = object()


def field_of(cls: type, key: Any) -> Optional[FieldSpec]:
    """The field of dataclass `cls` that `key` (a field name or an alias) names, or None."""
    return _fields(cls).get(getattr(cls, "_field_aliases", {}).get(key, key))


@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> dict[str, FieldSpec]:
    """The `FieldSpec` of every field of dataclass `cls`, by name, all compiled (reading and
    writing a section visits them all)."""
    return dict(specs(cls).items())


def unknown_key(cls: type, key: Any) -> tuple[str, str]:
    """(message, fix) for a key that names no field of `cls`; the fix names the closest fields."""
    close = suggest(key, [*specs(cls), *getattr(cls, "_field_aliases", ())])
    return f"unknown key: {cls.__name__} has no field {key!r}", close or "remove it"


def is_default(f: FieldSpec, value: Any) -> bool:
    """Whether `value` equals the class default of field `f` (a required field has none)."""
    return not f.required and values_equal(value, f.default)


# ====================================================================== writing
class ConfigEncoder(Encoder):
    """`Encoder` that writes dataclass sections with `_target_` and the explicit-field tags."""

    def section(self, obj: Any) -> dict:
        """A dataclass section: `_target_`, the bookkeeping tags, then every field."""
        path = name_of(type(obj))
        if path is None:
            return {UNSERIALIZABLE: show(obj)}
        state = obj.__dict__ if is_config(obj) else None  # its explicit/derived bookkeeping
        explicit, derived = (state.get(_EXPLICIT, ()), state.get(_DERIVED, {})) if state is not None else ((), {})
        fields: dict[str, Any] = {}
        tags: dict[str, list[str]] = {EXPLICIT: [], IMPLICIT: [], DERIVED: []}
        for f in _fields(type(obj)).values():
            value = getattr(obj, f.name, _NO_DEFAULT)
            if value is _NO_DEFAULT:  # an init=False field never set
                continue
            fields[f.name] = self.value(value, f.type)
            if state is None:
                continue
            default = is_default(f, value)
            # Only a value derived from the default can be recomputed from the saved file.
            before = derived.get(f.name, _NO_DEFAULT)
            recomputable = before is not _NO_DEFAULT and (before is _MISSING or is_default(f, before))
            if f.name in explicit and not (recomputable and not default):
                if default:
                    tags[EXPLICIT].append(f.name)
            elif not default:
                # (a field the user set to its default, e.g. train_iters=None beside train_samples,
                # then derived, is saved as derived: the user's value was the default)
                tags[DERIVED if recomputable else IMPLICIT].append(f.name)
        out: dict[str, Any] = {TARGET: path}
        out.update((tag, FlowList(sorted(names))) for tag, names in tags.items() if names)
        out.update(fields)
        return out


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain nested data for a config (`_target_` class paths, readable values); see the module
    docstring. `from_dict` turns it back into an equal config. Secrets are concealed
    (`config.secrets`): every writer and printer of configs goes through here."""
    return conceal(ConfigEncoder().value(obj))


class _Resolver(yaml.resolver.Resolver):
    """Which strings the writer may leave unquoted: those YAML does not read as another type
    (`1e-4` counts as a float, as the config loader reads it)."""


read_exponent_floats(_Resolver)
_TAGS = {t: f"tag:yaml.org,2002:{t.__name__}" for t in (str, int, float, bool)} | {type(None): "tag:yaml.org,2002:null"}


@functools.lru_cache(maxsize=4096)
def _scalar_event(tag: str, text: str) -> yaml.ScalarEvent:
    """The event of a scalar: written plain where it reads back as `tag`, else quoted (strings) or tagged."""
    plain = _Resolver.resolve(_Resolver, yaml.ScalarNode, text, (True, False)) == tag
    return yaml.ScalarEvent(None, tag, (plain, tag == _TAGS[str]), text)


def _events(data: Any, out: list) -> None:
    """Append the YAML events of `to_dict` output `data` to `out` (block style; `FlowList`s on one line)."""
    kind = type(data)
    if kind is dict:
        out.append(yaml.MappingStartEvent(None, None, True, flow_style=False))
        for key, value in data.items():
            _events(key, out)
            _events(value, out)
        out.append(yaml.MappingEndEvent())
    elif kind is list or kind is FlowList:
        out.append(yaml.SequenceStartEvent(None, None, True, flow_style=kind is FlowList))
        for item in data:
            _events(item, out)
        out.append(yaml.SequenceEndEvent())
    elif kind in _TAGS:  # floats at their shortest round-trip form (`1e-05`), and `.nan`, `.inf`, `-.inf`
        text = str(data).lower().replace("inf", ".inf").replace("nan", ".nan") if kind is not str else data
        out.append(_scalar_event(_TAGS[kind], "null" if data is None else text))
    else:
        raise yaml.representer.RepresenterError("cannot represent an object", data)


def to_yaml(obj: Any, path: Optional[Union[str, os.PathLike]] = None) -> str:
    """YAML text of a config; also written to `path` (parent directories created) when given."""
    events = [yaml.StreamStartEvent(), yaml.DocumentStartEvent()]
    _events(to_dict(obj), events)
    events += [yaml.DocumentEndEvent(), yaml.StreamEndEvent()]
    text = yaml.emit(events, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), allow_unicode=True, width=10000)
    if path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    return text


# ====================================================================== reading
class ConfigDecoder(Decoder):
    """`Decoder` that builds dataclass sections (`section`) or merges mappings into existing ones
    (`merge`): the one reader of config mappings, whatever their source (see the module docstring)."""

    def section(self, raw: Mapping, declared: tuple[type, ...]) -> Any:
        """A new section of the class `raw` describes (`section_class`), built from `raw`."""
        cls = self.section_class(raw, declared)
        raw = _with_moved_fields(cls, raw)
        tags, values, errors = self.read_section(cls, raw)
        present = {getattr(cls, "_field_aliases", {}).get(k, k) for k in raw if k not in SECTION_TAGS}
        fields = _fields(cls)
        for f in fields.values():
            if f.required and f.init and f.name not in present:
                errors.append((f.name, f"is required by {cls.__name__} but missing", f"add {f.name}"))
        if errors:
            raise DecodeError(items=errors)
        try:
            obj = cls(**{n: v for n, v in values.items() if fields[n].init})
        except (TypeError, ValueError, AssertionError) as exc:
            raise DecodeError(f"cannot build {cls.__name__}: {exc}", "fix the fields it names") from None
        for name, value in values.items():
            if not fields[name].init:
                object.__setattr__(obj, name, value)
        if is_config(obj):  # which fields are the user's: the module docstring's rule
            if TARGET in raw:
                explicit = {f.name for f in fields.values() if _users(tags, f, getattr(obj, f.name, None))}
            else:
                explicit = (present | tags[EXPLICIT]) - tags[IMPLICIT]
            obj.__dict__[_EXPLICIT] = explicit
            # The next finalize puts the default back and recomputes the field (as `ConfigBase._derive` does).
            obj.__dict__.setdefault(_DERIVED, {}).update((n, fields[n].fresh_default()) for n in tags[DERIVED])
        return obj

    def field(self, f: FieldSpec, raw: Any, current: Any = _NO_DEFAULT) -> Any:
        """The new value of field `f` from plain data. Given the `current` value, a plain mapping
        merges into it (a section, or a dict) instead of replacing it."""
        if type(raw) is _as_is(f):  # the common case, decided without `value`
            return raw
        if current is not _NO_DEFAULT and isinstance(raw, Mapping) and not is_value_tag(raw):
            classes = section_classes(f.type)
            if classes:
                try:
                    section = section_from_value(current, f.type)
                except ConfigValidationError as exc:
                    raise DecodeError(items=[("", p.message, p.fix) for p in exc.problems]) from None
                return self.section(raw, classes) if section is None else self.merge(section, raw)
            if isinstance(current, dict) and TARGET not in raw:
                return merge_dicts(current, self.field(f, raw))
        # None is accepted where the default is None even if the annotation does not say Optional
        # (as megatron-core declares many fields).
        return None if raw is None and f.default is None else self.value(raw, f.type)

    def merge(self, obj: Any, raw: Mapping) -> Any:
        """Merge section mapping `raw` into dataclass `obj`; returns `obj`, or a new section when
        `raw` has a `_target_` naming another class. Fields that decode are set even when others
        do not; the problems are then raised together as one DecodeError."""
        if TARGET in raw and self.section_class(raw, ()) is not type(obj):
            return self.section(raw, ())
        raw = _with_moved_fields(type(obj), raw)
        tags, values, errors = self.read_section(type(obj), raw, obj)
        for name, value in values.items():
            try:
                if not (value is getattr(obj, name, None) and dataclasses.is_dataclass(value)):  # merged in place
                    setattr(obj, name, value)  # type-checked; marks the field as the user's
            except (TypeError, ValueError) as exc:
                errors.append((name, str(exc), "use a value of the declared type"))
                continue
            if TARGET in raw and is_config(obj):  # a saved section: the file says who set it
                f = _fields(type(obj))[name]
                obj.mark_explicit(name, _users(tags, f, value))
                if name in tags[DERIVED]:
                    obj.__dict__.setdefault(_DERIVED, {})[name] = f.fresh_default()
        if errors:
            raise DecodeError(items=errors)
        return obj

    def read_section(self, cls: type, raw: Mapping, current: Any = None) -> tuple[dict[str, set[str]], dict, list]:
        """Read a section mapping: (the field names its bookkeeping tags list, {field name: new value},
        problems); `_implicit_` there also holds those of `_derived_`: every field the framework set.

        With `current` (the section being merged into), a plain mapping merges into the field's value.
        A runtime object the framework installed (a placeholder in an `_implicit_`/`_derived_` field,
        e.g. the loss-scaling hook of a saved run) is left out, so the field keeps its default and
        the framework installs it again; a user's value without a YAML form is an error."""
        tags: dict[str, set[str]] = {EXPLICIT: set(), IMPLICIT: set(), DERIVED: set()}
        errors: list[tuple[str, str, str]] = []
        for tag, names in tags.items():  # the field names each bookkeeping tag lists
            listed = raw.get(tag)
            if listed is not None and not (isinstance(listed, list) and all(isinstance(n, str) for n in listed)):
                errors.append((tag, f"must be a list of field names, got {show(listed)}", "e.g. [num_layers]"))
                continue
            for n in listed or ():
                f = field_of(cls, n)
                if f is None:
                    errors.append((tag, f"{n!r} is not a field of {cls.__name__}", unknown_key(cls, n)[1]))
                else:
                    names.add(f.name)
        tags[IMPLICIT] |= tags[DERIVED]
        values: dict[str, Any] = {}
        for key, item in raw.items():
            if key in SECTION_TAGS:
                continue
            f = field_of(cls, key)
            if f is None:
                errors.append((str(key), *unknown_key(cls, key)))
            elif f.name in values:
                errors.append((str(key), f"{f.name!r} is given twice (once through an alias)", "keep one"))
            elif f.name in tags[IMPLICIT] and is_value_tag(item) and UNSERIALIZABLE in item:
                logger.info("%s.%s: the saved run had a runtime object here; using the default", cls.__name__, f.name)
            else:
                try:
                    merged_into = _NO_DEFAULT if current is None else getattr(current, f.name, None)
                    values[f.name] = self.field(f, item, merged_into)
                except DecodeError as exc:
                    errors.extend(exc.under(key).items)
        return tags, values, errors

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
        # The concrete class that knows the most keys; `section` reports the keys it does not.
        keys = [k for k in raw if k not in SECTION_TAGS]
        candidates = [c for c in declared if not inspect.isabstract(c)]
        if not candidates:
            raise DecodeError(f"cannot tell which {names} this is", "add _target_ with the class's import path")
        return min(candidates, key=lambda c: sum(1 for k in keys if field_of(c, k) is None))


def _users(tags: dict[str, set[str]], f: FieldSpec, value: Any) -> bool:
    """Whether field `f` of a saved section (one with `_target_`) is the user's: listed in
    `_explicit_`, or not the default and not listed as the framework's."""
    return f.name in tags[EXPLICIT] or (f.name not in tags[IMPLICIT] and not is_default(f, value))


@functools.lru_cache(maxsize=None)
def _as_is(f: FieldSpec) -> Optional[type]:
    """The scalar type whose values field `f` takes as they are (`int` for `int` and `Optional[int]`),
    or None. (Cached by field: hashing a typing annotation costs more than the lookup saves.)"""
    arms = real_arms(f.type)
    return arms[0] if len(arms) == 1 and arms[0] in (str, int, float, bool) else None


def _with_moved_fields(cls: type, raw: Mapping) -> Mapping:
    """`raw` with each key of `cls._moved_fields` (a field that moved into a section) put into that
    section's mapping, with the bookkeeping tags that name it."""
    moved = [key for key in getattr(cls, "_moved_fields", {}) if key in raw]
    if not moved:
        return raw
    raw = dict(raw)
    for key in moved:
        section, name = cls._moved_fields[key].split(".")
        inner = raw.get(section, {})
        if not isinstance(inner, Mapping):
            continue  # reported where the section is read
        inner = raw[section] = {**inner, name: raw.pop(key)}
        for tag in (EXPLICIT, IMPLICIT, DERIVED):
            listed = raw.get(tag)
            if isinstance(listed, list) and key in listed:
                raw[tag] = [n for n in listed if n != key]
                inner[tag] = [*inner.get(tag, ()), name]
    return raw


def merge_dicts(base: dict, update: Mapping) -> dict:
    """OmegaConf-style merge: nested dicts merge, everything else is replaced."""
    out = dict(base)
    for k, v in update.items():
        out[k] = merge_dicts(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def from_dict(data: Mapping, cls: Optional[type] = None, source: str = "") -> Any:
    """Build a config from `to_dict` output or a hand-written equivalent.

    `cls` is the expected class (the data's `_target_` may name a subclass); without it the data
    must carry `_target_`. Names resolve through `config.targets` only. All problems are raised
    together as one `ConfigValidationError`, tagged with `source` (e.g. `file my.yaml`) if given.
    """
    from megatron_bridge.config.interpolation import has_interpolation, resolve_interpolations  # it imports this module

    if not isinstance(data, Mapping):
        raise ConfigValidationError(ConfigProblem("", f"expected a mapping of sections, got {show(data)}"))
    problems = Problems()
    if has_interpolation(data, []):  # a written config holds `${oc.env:VAR}` where a value came from the environment
        data, _ = resolve_interpolations(None, data, [], problems, source)
    if not problems:
        try:
            return ConfigDecoder().section(data, (cls,) if cls is not None else ())
        except DecodeError as exc:
            exc.report(problems, source=source)
    problems.raise_if_any()


def from_yaml(path: Union[str, os.PathLike], cls: Optional[type] = None) -> Any:
    """Load a config from a YAML file written by `to_yaml` (or by hand); see `from_dict`."""
    data = load_file(path)
    if data is None:
        raise ConfigValidationError(ConfigProblem("", f"{os.fspath(path)} is empty", "write the config into it"))
    return from_dict(data, cls, f"file {os.fspath(path)}")
