"""`${...}` interpolation in config files and overrides, resolved by OmegaConf.

Only the config fields an interpolation refers to are converted to OmegaConf, and only when the
file or an override contains one: converting a whole 8B-model config takes ~45 ms, more than
applying dozens of overrides. OmegaConf's resolvers (`${oc.env:VAR}`, `${oc.select:...}`,
registered custom ones) work as usual.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Mapping
from typing import Any, Callable, Iterable

from megatron_bridge.config.apply import Override
from megatron_bridge.config.errors import Problems, show
from megatron_bridge.config.secrets import remember_environment_reads
from megatron_bridge.config.serialization import ConfigEncoder, field_of

_INTERPOLATION = re.compile(r"\$\{([^{}]*)")
_UNRESOLVED = object()

MAX_NESTING = 16
"""Deepest nesting of `${...}` inside one another that is resolved."""


def _nesting(text: str) -> int:
    """How deeply `${` ... `}` pairs nest in `text`."""
    tokens = re.findall(r"\$\{|\}", text)
    return max(itertools.accumulate(tokens, lambda depth, t: depth + 1 if t == "${" else max(depth - 1, 0), initial=0))


def strings(value: Any) -> Iterable[str]:
    """Every string inside nested dicts and lists."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (Mapping, list)):
        for v in value.values() if isinstance(value, Mapping) else value:
            yield from strings(v)


def has_interpolation(data: Any, overrides: list[Override]) -> bool:
    """Whether the file data or an override value contains `${`."""
    return any("${" in s for s in strings([data, *(o.value for o in overrides)]))


def resolve_interpolations(
    config: Any,
    data: Any,
    overrides: list[Override],
    problems: Problems,
    file_label: str = "config file",
) -> tuple[Any, list[Override]]:
    """The file data and overrides with `${...}` resolved by OmegaConf against the config
    sections they refer to, the file and the overrides (so a later override of a referenced key
    is seen, as with Hydra); with `config` None, `data` is a whole config and refers to itself.
    An unresolvable value is reported into `problems` (tagged with its source) and dropped; so is one
    whose interpolations nest too deeply (OmegaConf recurses over them). Data OmegaConf cannot
    hold is reported at path '' and nothing is kept: (None, [])."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    def shallow(path: str, value: Any, source: str = file_label) -> Any:
        if any("${" in s and _nesting(s) > MAX_NESTING for s in strings(value)):
            message = f"interpolations nest deeper than {MAX_NESTING} levels"
            problems.add(path, message, "simplify the ${...} expression", source=source)
            return _UNRESOLVED
        return value

    def resolved(path: str, value: Any, source: str = file_label) -> Any:
        if not any("${" in s for s in strings(value)):
            return value
        try:
            node = OmegaConf.select(tree, path, throw_on_missing=True)
            return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        except (OmegaConfBaseException, RecursionError, ValueError) as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            problems.add(path, f"cannot resolve {show(value)}: {reason}", "fix the interpolation", source=source)
            return _UNRESOLVED  # reported once here, not again as a type error

    try:
        data = _walk(data, "", shallow)
        overrides = [o for o in overrides if shallow(o.dotted, o.value, o.source) is not _UNRESOLVED]
        texts = [text for text in strings([data, *(o.value for o in overrides)]) if "${" in text]
        remember_environment_reads(texts)  # what the config is written with puts `${oc.env:VAR}` back
        refs = []
        for text in texts:
            for ref in _INTERPOLATION.findall(text):  # of `oc.select:model.x,1`, the arguments
                refs += [part.strip() for part in ref.split(":", 1)[-1].split(",")]
        fields = _referenced(config, refs) if config is not None else {}
        tree = OmegaConf.merge(*(map_strings(part, lambda s: s) for part in (fields, data or {})))
        for o in overrides:
            if o.op != "delete":
                try:
                    OmegaConf.update(tree, o.dotted, o.value, merge=True, force_add=True)
                except (OmegaConfBaseException, ValueError, KeyError, IndexError):
                    pass  # applying the override reports what is wrong with it
    except RecursionError:  # OmegaConf recurses over nested data
        problems.add("", "interpolations nest too deeply to resolve", "simplify the ${...} expressions")
        return None, []
    except (OmegaConfBaseException, ValueError, TypeError) as exc:  # values OmegaConf cannot hold
        problems.add("", f"cannot resolve its interpolations: {str(exc).splitlines()[0][:200]}", "fix the ${...}")
        return None, []
    overrides = [
        o if o.op == "delete" else dataclasses.replace(o, value=resolved(o.dotted, o.value, o.source))
        for o in overrides
    ]
    return _walk(data, "", resolved), [o for o in overrides if o.value is not _UNRESOLVED]


def _walk(value: Any, path: str, leaf: Callable[[str, Any], Any]) -> Any:
    """`value` with `leaf(path, v)` in place of each value below it that is not a mapping (a list
    is one value); keys whose new value is `_UNRESOLVED` are left out."""
    if not isinstance(value, Mapping):
        return leaf(path, value)
    items = ((k, _walk(v, f"{path}.{k}" if path else str(k), leaf)) for k, v in value.items())
    return {k: v for k, v in items if v is not _UNRESOLVED}


def _referenced(config: Any, refs: list[str]) -> dict:
    """The fields of `config` that interpolation references name, encoded as plain data in a
    tree of their dotted paths. A relative reference (`${.x}`) may name anything: then every
    section is included."""
    encoder = ConfigEncoder()
    if any(ref.startswith(".") for ref in refs):
        return encoder.section(config)
    tree: dict = {}
    for ref in set(refs):
        obj, node, parts = config, tree, ref.split(".")
        for i, part in enumerate(parts):
            f = field_of(type(obj), part)
            if f is None:
                break  # not in the config: the file may define it, or OmegaConf reports it
            value = getattr(obj, f.name)
            if i == len(parts) - 1 or not dataclasses.is_dataclass(value) or isinstance(value, type):
                node[part] = encoder.value(value, f.type)
                break
            node, obj = node.setdefault(part, {}), value
    return tree


def map_strings(value: Any, fn: Callable[[str], Any]) -> Any:
    """`value` with `fn` applied to every string in it (dict keys included), its dicts and lists
    rebuilt as plain ones (OmegaConf refuses their subclasses)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {map_strings(k, fn): map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [map_strings(v, fn) for v in value]
    return value
