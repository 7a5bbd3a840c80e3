"""`--help-config [SECTION]`: the fields of a config section with their types, values, class
defaults, ranges, statuses and docstrings, all read from the fields' `FieldSpec`s
(`megatron_bridge.config.schema`).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import inspect
import re
from typing import Any, Optional

from megatron_bridge.cli.errors import UsageError
from megatron_bridge.config.annotations import describe, field_types, section_classes, section_from_value
from megatron_bridge.config.base import values_equal
from megatron_bridge.config.schema import specs
from megatron_bridge.config.secrets import conceal

OPTIONS = "options"
"""Pseudo-section: the keyword arguments of the recipe (`--recipe-arg KEY=VALUE`)."""

_NO_DEFAULT = object()


def class_summary(cls: type) -> str:
    """First line of the class docstring (dataclass's generated signature docstring does not count)."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):
        return ""
    return first_line(doc)


def first_line(doc: str) -> str:
    lines = inspect.cleandoc(doc).splitlines()
    return lines[0] if lines else ""


# ---------------------------------------------------------------------- rendering
def type_name(tp: Any) -> str:
    """`typing.Optional[megatron_bridge.x.TrainingConfig]` -> `Optional[TrainingConfig]`."""
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", describe(tp))


def show_value(value: Any) -> str:
    """A short rendering of a field value: functions and classes by name, sections by class."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"{type(value).__name__}(...)"
    if isinstance(value, functools.partial):
        return f"partial({show_value(value.func)}, ...)"
    if inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, enum.Enum):
        return value.name
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def class_default(spec: Any) -> Any:
    """The class default of field `spec` (a `FieldSpec`), or _NO_DEFAULT."""
    try:
        default = spec.default
    except Exception:  # a factory that needs a runtime: say so rather than fail the help
        return _NO_DEFAULT
    return _NO_DEFAULT if spec.required else default


def field_entry(spec: Any, value: Any, has_value: bool) -> list[str]:
    """Lines describing a field (its `FieldSpec`): `name: type = value  (class default: ...)`,
    then its range (numbers) and status, then its docstring."""
    default = class_default(spec)
    default_text = "required" if default is _NO_DEFAULT else show_value(default)
    kind = type_name(spec.type)
    if not has_value:
        head = f"{spec.name}: {kind} = {default_text}"
    elif default is not _NO_DEFAULT and values_equal(value, default):
        head = f"{spec.name}: {kind} = {show_value(value)}  (class default)"
    else:
        shown = show_value(conceal(value, spec.name))  # credentials and values from the environment
        head = f"{spec.name}: {kind} = {shown}  (class default: {default_text})"
    facts = f"range {spec.range}; " if spec.range is not None else ""
    lines = [f"  {head}", f"      {facts}status: {spec.status_text()}"]
    return lines + [f"      {line}" for line in spec.doc.splitlines()]


def fields_text(cls: type, obj: Any, only: Optional[str] = None) -> list[str]:
    """Every public field of dataclass `cls` (values from `obj`, if not None)."""
    lines: list[str] = []
    for spec in specs(cls).values():
        if spec.name.startswith("_") or (only is not None and spec.name != only):
            continue
        lines += field_entry(spec, getattr(obj, spec.name, None), obj is not None)
    return lines


# ---------------------------------------------------------------------- topics
def _section_of(value: Any, declared: Any) -> tuple[Optional[type], Any]:
    """(class, instance) of the section a field holds: its value, the config a preset name stands
    for, or, for a null field with one possible class, that class without an instance."""
    try:
        section = section_from_value(value, declared)
    except Exception:  # an unknown preset name: the field is shown as a plain value
        section = None
    if section is not None:
        return type(section), section
    classes = section_classes(declared)
    if value is None and classes:
        return classes[0], None  # several possible classes (peft: LoRA or DoRA): the first's fields
    return None, None


def _named_choices(declared: Any) -> tuple[str, ...]:
    """Short names of the section classes a field may hold (`lora`, `dora`), if they have them."""
    return tuple(c.config_name for c in section_classes(declared) if isinstance(getattr(c, "config_name", None), str))


def sections_text(cfg: Any, options: Any, label: str) -> list[str]:
    """One line per top-level field of `cfg`: name, class (or value), what it holds."""

    rows = []
    for spec in specs(type(cfg)).values():
        value = getattr(cfg, spec.name)
        cls, section = _section_of(value, spec.type)
        if cls is None:
            kind = f"{show_value(conceal(value, spec.name))} ({type_name(spec.type)})"
        elif section is None:
            names = [c.__name__ for c in section_classes(spec.type)]
            kind = f"None ({' or '.join(names)})"
        elif isinstance(value, str):
            kind = f"{value!r} ({cls.__name__} preset)"
        else:
            kind = cls.__name__
        about = first_line(spec.doc) or (class_summary(cls) if cls else "")
        rows.append((spec.name, kind, about))
    if options is not None:
        rows.append((OPTIONS, type(options).__name__, "Keyword arguments of the recipe (--recipe-arg KEY=VALUE)."))
    w1 = max(len(r[0]) for r in rows) + 2
    w2 = min(max(len(r[1]) for r in rows), 40) + 2
    head = f"Sections of {label}; `--help-config SECTION` lists the fields of one (SECTION.FIELD: one field):"
    return [head, *(f"  {n:<{w1}}{k:<{w2}}{a}".rstrip() for n, k, a in rows)]


def _unknown(name: str, choices: list[str], where: str) -> UsageError:
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else f"; choose from {', '.join(choices)}"
    return UsageError(f"--help-config: {where} has no section or field {name!r}{hint}")


def help_text(cfg: Any, topic: str, options: Any = None, label: str = "the config") -> str:
    """The help for `topic`: '' lists the sections; 'train' the fields of a section;
    'train.train_iters' one field; 'options' the recipe's options (when `options` is given)."""
    if not topic:
        return "\n".join(sections_text(cfg, options, label))

    parts = topic.split(".")
    cls: Optional[type] = type(cfg)
    obj: Any = cfg
    if parts[0] == OPTIONS and options is not None:
        cls, obj, parts = type(options), options, parts[1:]
    path: list[str] = []
    choices: tuple = ()
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
        where = ".".join(path) or cls.__name__
        if part not in names:
            raise _unknown(part, names, where)
        value = getattr(obj, part) if obj is not None else None
        sub_cls, sub_obj = _section_of(value, field_types(cls)[part])
        choices = _named_choices(field_types(cls)[part])
        if sub_cls is None:
            if i != len(parts) - 1:
                raise UsageError(f"--help-config: {'.'.join([*path, part])} is a field, not a section")
            return "\n".join(fields_text(cls, obj, only=part))
        cls, obj = sub_cls, (sub_obj if obj is not None else None)
        path.append(part)
    title = ".".join(path) or OPTIONS
    summary = class_summary(cls)
    head = f"{title} ({cls.__name__}){': ' + summary if summary else ''}"
    if obj is None and len(choices) > 1:
        picks = " or ".join(f"{title}={name}" for name in choices)
        head += f"\n  {title} is None: the class defaults of {cls.__name__} are shown; {picks} creates one."
    elif obj is None:
        head += f"\n  {title} is None: the class defaults are shown; setting a field creates it."
    return "\n".join([head, *fields_text(cls, obj)])
