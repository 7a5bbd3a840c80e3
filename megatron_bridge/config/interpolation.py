"""`${...}` interpolation in config files and overrides, resolved by OmegaConf.

Only the config fields an interpolation refers to are converted to OmegaConf, and only when the
file or an override contains one: converting a whole 8B-model config takes ~45 ms, more than
applying dozens of overrides. OmegaConf's resolvers (`${oc.env:VAR}`, `${oc.select:...}`,
registered custom ones) work as usual.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Callable, Iterable

from megatron_bridge.config.apply import NO_VALUE, Override
from megatron_bridge.config.errors import show
from megatron_bridge.config.serialization import ConfigEncoder, class_info

_INTERPOLATION = re.compile(r"\$\{([^{}]*)")
_UNRESOLVED = object()

MAX_NESTING = 16
"""Deepest nesting of `${...}` inside one another that is resolved."""


def _too_deep(value: Any) -> bool:
    return any("${" in s and _nesting(s) > MAX_NESTING for s in strings(value))


def _drop_deep(data: Any, overrides: list[Override], report: Callable, file_label: str) -> tuple[Any, list[Override]]:
    """Values whose interpolations nest too deeply to resolve (OmegaConf recurses over them),
    reported and left out."""
    problem = f"interpolations nest deeper than {MAX_NESTING} levels"
    kept = []
    for o in overrides:
        if o.value is not NO_VALUE and _too_deep(o.value):
            report(o.dotted, problem, "simplify the ${...} expression", f"override {show(o.text)}")
        else:
            kept.append(o)

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, Mapping):
            items = ((k, walk(v, f"{path}.{k}" if path else str(k))) for k, v in value.items())
            return {k: v for k, v in items if v is not _UNRESOLVED}
        if _too_deep(value):
            report(path, problem, "simplify the ${...} expression", file_label)
            return _UNRESOLVED
        return value

    return (walk(data, "") if data else data), kept


def _nesting(text: str) -> int:
    """How deeply `${` ... `}` pairs nest in `text`."""
    depth = deepest = 0
    i = 0
    while i < len(text):
        if text.startswith("${", i):
            depth += 1
            deepest = max(deepest, depth)
            i += 2
            continue
        if text[i] == "}" and depth:
            depth -= 1
        i += 1
    return deepest


def strings(value: Any) -> Iterable[str]:
    """Every string inside nested dicts and lists."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def has_interpolation(data: Any, overrides: list[Override]) -> bool:
    """Whether the file data or an override value contains `${`."""
    return any("${" in s for s in strings(data)) or any(
        "${" in s for o in overrides if o.value is not NO_VALUE for s in strings(o.value)
    )


def resolve_interpolations(
    config: Any,
    data: Any,
    overrides: list[Override],
    report: Callable[[str, str, str, str], None],
    file_label: str = "config file",
) -> tuple[Any, list[Override]]:
    """The file data and overrides with `${...}` resolved by OmegaConf against the config
    sections they refer to, the file and the overrides (so a later override of a referenced key
    is seen, as with Hydra). An unresolvable value is reported as (path, message, fix, source)
    and dropped."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    data, overrides = _drop_deep(data, overrides, report, file_label)
    texts = [s for s in strings(data) if "${" in s]
    texts += [s for o in overrides if o.value is not NO_VALUE for s in strings(o.value) if "${" in s]
    refs = []
    for text in texts:
        for ref in _INTERPOLATION.findall(text):
            ref = ref.split(":", 1)[1] if ":" in ref else ref  # `oc.select:model.x,1`: look at the arguments
            refs += [part.strip() for part in ref.split(",")]
    tree = OmegaConf.create(_referenced(config, refs))
    if data:
        tree = OmegaConf.merge(tree, OmegaConf.create(dict(data)))
    for o in overrides:
        if o.op != "delete":
            try:
                OmegaConf.update(tree, o.dotted, o.value, merge=True, force_add=True)
            except (OmegaConfBaseException, ValueError, KeyError, IndexError):
                pass  # the real application below reports what is wrong with this override

    def resolved(path: str, value: Any, source: str) -> Any:
        if not any("${" in s for s in strings(value)):
            return value
        try:
            node = OmegaConf.select(tree, path, throw_on_missing=True)
            return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        except (OmegaConfBaseException, RecursionError, ValueError) as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            report(path, f"cannot resolve {show(value)}: {reason}", "fix the interpolation", source)
            return _UNRESOLVED  # reported once here, not again as a type error

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, Mapping):
            items = ((k, walk(v, f"{path}.{k}" if path else str(k))) for k, v in value.items())
            return {k: v for k, v in items if v is not _UNRESOLVED}
        if isinstance(value, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(value)]
        return resolved(path, value, file_label)

    data = walk(data, "") if data else data
    out = []
    for o in overrides:
        if o.value is not NO_VALUE and o.op != "delete":
            o = dataclasses.replace(o, value=resolved(o.dotted, o.value, f"override {show(o.text)}"))
        if o.value is not _UNRESOLVED:
            out.append(o)
    return data, out


def _referenced(config: Any, refs: list[str]) -> dict:
    """The fields of `config` that interpolation references name, encoded as plain data in a
    tree of their dotted paths. A relative reference (`${.x}`) may name anything: then every
    section is included."""
    encoder = ConfigEncoder()
    info = class_info(type(config))
    if any(ref.startswith(".") for ref in refs):
        return {f.name: _plain(encoder.value(getattr(config, f.name), f.type)) for f in info.fields}
    tree: dict = {}
    for ref in sorted(set(refs), key=len):  # a shorter path may already hold a longer one
        obj, node, parts = config, tree, ref.split(".")
        for i, part in enumerate(parts):
            if isinstance(node.get(part), _Whole):
                break
            here = class_info(type(obj))
            f = here.by_name.get(here.aliases.get(part, part))
            if f is None:
                break  # not in the config: the file may define it, or OmegaConf reports it
            value = getattr(obj, f.name)
            if i == len(parts) - 1 or not dataclasses.is_dataclass(value) or isinstance(value, type):
                node[part] = _Whole(_plain(encoder.value(value, f.type)))
                break
            node = node.setdefault(part, {})
            obj = value
    return _unwrap(tree)


class _Whole:
    """Marks a field included whole in the reference tree."""

    def __init__(self, value: Any):
        self.value = value


def _unwrap(tree: Any) -> Any:
    if isinstance(tree, _Whole):
        return tree.value
    if isinstance(tree, dict):
        return {k: _unwrap(v) for k, v in tree.items()}
    return tree


def _plain(value: Any) -> Any:
    """Encoded data with list subclasses (which OmegaConf refuses) turned into lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
