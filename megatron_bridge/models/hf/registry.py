"""The Hugging Face architectures we convert: each family module registers its `HFFamily`.

A family module (`megatron_bridge.models.llama`, ...) defines its providers and, decorated with
`register`, the family that converts them. The family modules are those the `megatron_bridge.models`
index lists; they are imported the first time a family is looked up. A config.json is matched on
`architectures` (or `model_type` when it has none); a provider on what it computes (`mismatches`),
the family of its own class (or the nearest one) winning where several could write it.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_bridge.config.errors import Problems, show
from megatron_bridge.models import family_modules

_REGISTERED: dict[str, Any] = {}
_LOADED = False


def register(cls: type) -> type:
    """Class decorator: make the `HFFamily` subclass `cls` a convertible architecture."""
    family = cls()
    other = _REGISTERED.get(family.architecture)
    if other is not None and type(other).__qualname__ != cls.__qualname__:
        raise ValueError(f"{family.architecture} is registered twice ({type(other).__name__} and {cls.__name__})")
    _REGISTERED[family.architecture] = family
    return cls


def families() -> list[Any]:
    """Every registered family, sorted by architecture name."""
    global _LOADED
    if not _LOADED:
        import importlib

        for module in family_modules():
            importlib.import_module(module)
        _LOADED = True
    return [_REGISTERED[name] for name in sorted(_REGISTERED)]


def supported() -> str:
    """The architectures we convert, for messages."""
    return ", ".join(f.architecture for f in families())


def family_of(hf: dict, problems: Problems, where: str = "config.json") -> Optional[Any]:
    """The family of a config.json, or None (with a problem naming the `architectures` field)."""
    known = families()
    by_architecture = {f.architecture: f for f in known}
    by_model_type = {f.model_type: f for f in known}
    names = hf.get("architectures")
    if names is None and hf.get("model_type") in by_model_type:
        return by_model_type[hf["model_type"]]
    if not isinstance(names, list) or len(names) != 1 or names[0] not in by_architecture:
        problems.add("", f"{where}: architectures={show(names)} is not supported", f"convert one of: {supported()}")
        return None
    return by_architecture[names[0]]


def family_for_config(hf: dict) -> Any:
    """The family of an accepted config.json (`ValueError` if it has none)."""
    problems = Problems()
    family = family_of(hf, problems)
    if family is None:
        raise ValueError(str(next(iter(problems))))
    return family


def _distance(family_provider: type, cls: type) -> int:
    """How far apart two provider classes are in the class tree (0: the same class)."""
    if family_provider in cls.__mro__:
        return cls.__mro__.index(family_provider)
    if cls in family_provider.__mro__:
        return family_provider.__mro__.index(cls)
    return 1_000


def family_of_provider(provider: Any, problems: Optional[Problems] = None) -> Optional[Any]:
    """The family that computes what `provider` computes, or None (with, in `problems`, the
    settings the nearest family cannot express). Of several, the one whose provider class is
    nearest to the provider's class."""
    known = families()
    found = [(_distance(f.provider, type(provider)), f.architecture, f) for f in known if not f.mismatches(provider)]
    if found:
        return min(found, key=lambda t: t[:2])[2]
    if problems is not None:
        scored = [
            (len(f.mismatches(provider)), _distance(f.provider, type(provider)), f.architecture, f) for f in known
        ]
        nearest = min(scored, key=lambda t: t[:3])[3]
        for name, value in nearest.mismatches(provider):
            problems.add(
                f"model.{name}",
                f"{show(value)} has no Hugging Face counterpart among {supported()}",
                "export a model of one of these architectures",
            )
    return None
