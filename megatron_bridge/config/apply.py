"""The one way values enter a config: mappings (a YAML file, a merge, a recipe's options, a saved
config) and parsed command-line overrides are applied here, every value decoded against the
declared type of its field (`model.params_dtype=bf16` gives a torch dtype,
`model.activation_func=silu` a function; see `config.annotations`), set through the config's
type-checked assignment, and counted as set by the user. Problems are collected, each tagged
with its source (`[file my.yaml]`, `[override 'optimizer.lr=x']`), and raised together as one
`ConfigValidationError`; on error the config may be partly updated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megatron_bridge.config.annotations import (
    TARGET,
    DecodeError,
    container_item_type,
    section_classes,
    section_from_value,
    suggest,
    values_equal,
)
from megatron_bridge.config.base import ConfigBase
from megatron_bridge.config.errors import ConfigValidationError, Problems, show
from megatron_bridge.config.serialization import ConfigDecoder, field_of, merge_dicts, unknown_key

NO_VALUE = object()
"""The value of a `~key` override given without `=value`."""


@dataclasses.dataclass(frozen=True)
class Override:
    """One parsed override."""

    op: str
    """'set' (key=v), 'add' (+key=v), 'force' (++key=v) or 'delete' (~key)."""
    key: tuple[str, ...]
    value: Any
    text: str

    @property
    def dotted(self) -> str:
        return ".".join(self.key)

    @property
    def source(self) -> str:
        """How problems with this override name it: `override 'optimizer.lr=x'`."""
        return f"override {show(self.text)}"


class Applier:
    """Applies mappings and parsed overrides to a config, collecting problems tagged with their source."""

    def __init__(self, config: Any, problems: Problems):
        self.config = config
        self.problems = problems
        self.loader = ConfigDecoder()

    def error(self, path: str, message: str, fix: str, source: str) -> None:
        self.problems.add(path, message, fix, source=source)

    def merge(self, data: Mapping, source: str) -> None:
        """Merge mapping `data` (a file, a recipe's options) into the config, reporting problems
        with their `source`."""
        try:
            if TARGET in data and self.loader.section_class(data, ()) is not type(self.config):
                message = f"_target_ {data[TARGET]!r} does not match the config's class"
                return self.error("", message, "remove it", source)
            self.loader.merge(self.config, data)
        except DecodeError as exc:
            exc.report(self.problems, "", source)

    def assign(self, obj: Any, name: str, value: Any, path: str, source: str) -> None:
        try:
            setattr(obj, name, value)  # type-checked; marks the field as the user's
        except (TypeError, ValueError) as exc:
            self.error(path, str(exc), "use a value of the declared type", source)

    def apply(self, o: Override) -> None:
        """Apply one parsed override: walk down the dataclass sections; the key parts left when
        a field is not a section address items in its value."""
        obj, source = self.config, o.source
        try:
            for i, part in enumerate(o.key):
                f, where, last = field_of(type(obj), part), ".".join(o.key[: i + 1]), i == len(o.key) - 1
                if f is None:
                    message, fix = unknown_key(type(obj), part)
                    elsewhere = self.sections_with_field(part, obj) if last else []
                    if elsewhere:  # `train_iters=5`, `model.train_iters=5`: the right name, the wrong section
                        fix = f"did you mean {' or '.join(elsewhere)}?"
                    if o.op == "add" and last:
                        message = f"cannot add key {part!r}: {type(obj).__name__} has a fixed set of fields"
                    return self.error(where, message, fix, source)
                if last:
                    return self.apply_to_field(obj, f, o, where, source)
                current, classes = getattr(obj, f.name), section_classes(f.type)
                named = [c.config_name for c in classes if isinstance(getattr(c, "config_name", None), str)]
                creates = current is None and o.op != "delete"  # `ft.enable_ft_package=true` while ft is null
                if creates and len(named) > 1:
                    picks = " or ".join(f"{where}={n}" for n in named)
                    message = f"is null, so it has no key {o.key[i + 1]!r}"
                    return self.error(where, message, f"choose one first: {picks}", source)
                try:
                    section = classes[0]() if creates and len(classes) == 1 else section_from_value(current, f.type)
                except ConfigValidationError as exc:
                    for p in exc.problems:
                        self.error(where, p.message, p.fix, source)
                    return
                except TypeError as exc:  # a section class that cannot be built without arguments
                    message = f"is null and cannot be created empty: {exc}"
                    return self.error(where, message, f"set {where} as a whole", source)
                if section is None:
                    new = _update_item(self.loader, current, f.type, o, i + 1)
                    return self.assign(obj, f.name, new, where, source)
                if section is not current:
                    self.assign(obj, f.name, section, where, source)
                obj = section
        except DecodeError as exc:  # a value, or a key path into a dict or list, that does not fit
            exc.report(self.problems, o.dotted, source)

    def sections_with_field(self, name: str, besides: Any) -> list[str]:
        """`section.name` for each section of the config (other than `besides`) with a field `name`."""
        found = []
        for f in dataclasses.fields(self.config):
            section = getattr(self.config, f.name, None)
            if section is not besides and isinstance(section, ConfigBase) and field_of(type(section), name) is not None:
                found.append(f"{f.name}.{name}")
        return found

    def apply_to_field(self, obj: Any, f: Any, o: Override, path: str, source: str) -> None:
        current = getattr(obj, f.name, None)
        if o.op == "add":
            self.error(path, "already exists, so it cannot be added", f"use {o.text[1:]} or +{o.text}", source)
        elif o.op != "delete":
            value = self.loader.field(f, o.value, current)
            if not (value is current and dataclasses.is_dataclass(value)):  # a section merged in place
                self.assign(obj, f.name, value, path, source)
        elif f.required:
            self.error(path, "is required and has no default to reset to", "set a value instead", source)
        elif o.value is not NO_VALUE and not _decodes_to(self.loader, f, o.value, current):
            self.error(path, f"is {show(current)}, not {show(o.value)}", f"use ~{path}", source)
        elif isinstance(obj, ConfigBase):
            obj.apply_default(f.name, f.fresh_default())
            obj.mark_explicit(f.name, False)
        else:
            setattr(obj, f.name, f.fresh_default())


def _decodes_to(loader: Any, f: Any, raw: Any, current: Any) -> bool:
    try:
        return values_equal(loader.field(f, raw), current)
    except DecodeError:
        return False


def _update_item(loader: Any, node: Any, tp: Any, o: Override, i: int) -> Any:
    """A copy of container `node` (a field's dict/list/tuple value) with the override applied at
    key parts `o.key[i:]`; the caller assigns it back, so the field counts as set by the user."""
    part, last, here = o.key[i], i == len(o.key) - 1, ".".join(o.key[:i])
    if node is None and o.op in ("add", "force") and container_item_type(tp, None, dict) is not None:
        node = {}
    if isinstance(node, dict):
        key = part if part in node or not part.lstrip("-").isdigit() or int(part) not in node else int(part)
        if key not in node and last and o.op == "delete":
            raise DecodeError(f"{here} has no key {part!r} to remove", "check the key")
        if key not in node and o.op not in ("add", "force"):
            hint = suggest(part, [str(k) for k in node]) if last else ""
            raise DecodeError(f"{here} has no key {part!r}", f"{hint} use +{o.text} to add it".strip())
        if key in node and last and o.op == "add":
            raise DecodeError("already exists, so it cannot be added", f"use ++{o.text.lstrip('+')}")
        items, item_tp = dict(node), container_item_type(tp, key, dict) or Any
    elif isinstance(node, (list, tuple)):
        if not part.isdigit():
            raise DecodeError(f"{here} is a list; {part!r} is not an index", "use a number, e.g. .0")
        key = int(part)
        if key >= len(node):
            raise DecodeError(
                f"index {key} is out of range for a list of {len(node)}",
                f"use 0..{len(node) - 1}, or replace the whole list",
            )
        if o.op == "add":
            raise DecodeError("cannot add a list item by index", "replace the whole list: key=[a, b, c]")
        items, item_tp = dict(enumerate(node)), container_item_type(tp, key, type(node)) or Any  # by index
    else:
        kind = "null" if node is None else type(node).__name__
        raise DecodeError(f"{here} is {kind}, so it has no key {part!r}", "set the whole value instead")
    if not last:
        items[key] = _update_item(loader, items.get(key), item_tp, o, i + 1)
    elif o.op == "delete":
        del items[key]
    elif isinstance(node, dict):
        items = merge_dicts(items, {key: loader.value(o.value, item_tp)})
    else:
        items[key] = loader.value(o.value, item_tp)
    return items if isinstance(node, dict) else type(node)(items.values())
