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

_INTERPOLATION = re.compile(r"\$\{([^{}$]*)")  # `$` ends it: `${oc.decode:${x}}` names x
_UNRESOLVED = object()

MAX_NESTING = 16
"""Deepest nesting of `${...}` inside one another that is resolved."""

MAX_REFERENCES = 4096
"""Most `${...}` a config's values may expand to in all, counting each time a referenced value's
own `${...}` are expanded again (OmegaConf resolves a reference anew each time it is used, at
~0.2 ms each: `b: ${a}${a}`, `c: ${b}${b}`, ... doubles the work with each key)."""

MAX_RESOLVED_LENGTH = 16_000_000
"""Most characters a config's interpolated values may resolve to in all."""


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
            unset = re.search(r"Environment variable '([^']*)' not found", reason)
            fix = f"set {unset.group(1)} in the environment, or give a default: ${{oc.env:{unset.group(1)},DEFAULT}}" if unset else "fix the interpolation"
            problems.add(path, f"cannot resolve {show(value)}: {reason}", fix, source=source)
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
        interpolated = [(path, file_label) for path, value in _leaves(data) if any("${" in s for s in strings(value))]
        interpolated += [(o.dotted, o.source) for o in overrides if o.op != "delete" and has_interpolation(o.value, [])]
        too_large = _too_large(OmegaConf.to_container(tree, resolve=False), [path for path, _ in interpolated])
        if too_large is not None:
            problems.add(too_large, *_TOO_LARGE, source=dict(interpolated)[too_large])
            return None, []
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


_TOO_LARGE = (
    f"interpolations expand to more than {MAX_REFERENCES} references or {MAX_RESOLVED_LENGTH:,} characters "
    "(a value refers to another more than once, which refers to another more than once, ...)",
    "refer to each value once, or write the value out",
)


def _leaves(value: Any, path: str = "") -> Iterable[tuple[str, Any]]:
    """(dotted path, value) of every value below `value` that is not a mapping (as `_walk`)."""
    if not isinstance(value, Mapping):
        yield path, value
        return
    for k, v in value.items():
        yield from _leaves(v, f"{path}.{k}" if path else str(k))


def _too_large(tree: Any, paths: list[str]) -> str | None:
    """The first of `paths` (dotted, into plain data `tree`) whose value pushes the work of resolving
    them all past `MAX_REFERENCES` or `MAX_RESOLVED_LENGTH`; None when within both. Counts without
    resolving: each `${...}` is one reference, and a reference to a value costs that value's own
    (counted once, however often it is referred to). Resolver arguments that name a value
    (`${oc.select:a.b,x}`) count as references to it; a cycle counts nothing (OmegaConf reports it)."""
    costs: dict[tuple, tuple[int, int]] = {}

    def node(parts: tuple) -> tuple[bool, Any]:
        value = tree
        for part in parts:
            if isinstance(value, Mapping):
                match = [v for k, v in value.items() if str(k) == part]
                if not match:
                    return False, None
                value = match[0]
            elif isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
                value = value[int(part)]
            else:
                return False, None
        return True, value

    def target(ref: str, where: tuple) -> tuple | None:
        ref = re.sub(r"\[([^\]]*)\]", r".\1", ref.strip())
        if ref.startswith("."):
            up = len(ref) - len(ref.lstrip("."))
            if up > len(where) + 1:
                return None
            base, ref = where[: len(where) + 1 - up], ref.lstrip(".")
        else:
            base = ()
        parts = tuple(p for p in ref.split(".") if p)
        return base + parts if parts else None  # `${oc.decode:${x}}`: the outer one names nothing itself

    def cost(parts: tuple) -> tuple[int, int]:
        if parts in costs:
            return costs[parts]
        costs[parts] = (0, 0)  # in progress: a cycle adds nothing
        found, value = node(parts)
        references, length = 0, 0
        if isinstance(value, Mapping):
            for k in value:
                r, n = cost(parts + (str(k),))
                references, length = references + r, length + n + len(str(k))
        elif isinstance(value, list):
            for i in range(len(value)):
                r, n = cost(parts + (str(i),))
                references, length = references + r, length + n
        elif found:
            text = str(value)
            length = len(text)
            for ref in _INTERPOLATION.findall(text) if "${" in text else ():
                references += 1
                for name in [ref] if ":" not in ref else ref.split(":", 1)[1].split(","):
                    linked = target(name, parts[:-1])
                    if linked is not None and linked != parts and node(linked)[0]:
                        r, n = cost(linked)
                        references, length = references + r, length + n
                if references > MAX_REFERENCES or length > MAX_RESOLVED_LENGTH:
                    break
        costs[parts] = (references, length)
        return costs[parts]

    references, length = 0, 0
    for path in paths:
        r, n = cost(tuple(path.split(".")) if path else ())
        references, length = references + r, length + n
        if references > MAX_REFERENCES or length > MAX_RESOLVED_LENGTH:
            return path
    return None


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
