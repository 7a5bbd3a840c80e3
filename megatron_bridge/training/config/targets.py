"""Import paths of objects named in config files (`_target_`, callables) and the allowlist.

A YAML file or a command-line override can name a class or function to import. Importing runs a
module's code, so only objects under an allowlist of module prefixes are loaded; the user extends
it explicitly (`allow_target_prefix`, or `allowed_prefixes=` on the loading call).
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Iterable, Optional

DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = (
    "megatron_bridge.",
    "megatron.core.",
    "torch.",
    "recipes.",
    "functools.partial",
)

_user_prefixes: list[str] = []

# Namespaces tried first when naming a function, so the YAML says `torch.nn.functional.gelu`
# rather than the private module a builtin happens to live in (`torch._C._nn.gelu`).
_PREFERRED_NAMESPACES = ("torch.nn.functional", "torch.nn.init", "torch", "megatron.core.activations")

# Where short callable names (`silu`, `squared_relu`) are looked up, in order.
SHORT_NAME_NAMESPACES = ("torch.nn.functional", "megatron.core.activations")


class TargetNotAllowedError(ImportError):
    """An import path outside the allowlist; `.fix` says how to allow it."""

    def __init__(self, message: str, fix: str):
        super().__init__(f"{message}; {fix}")
        self.message = message
        self.fix = fix


def allow_target_prefix(prefix: str) -> None:
    """Allow `_target_`/callable import paths under `prefix` (e.g. 'mypkg.') for this process."""
    if not isinstance(prefix, str) or not prefix.strip("."):
        raise ValueError(f"allow_target_prefix needs a module prefix such as 'mypkg.', got {prefix!r}")
    if prefix not in _user_prefixes:
        _user_prefixes.append(prefix)


def allowed_prefixes(extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The prefixes in effect: defaults, those added by `allow_target_prefix`, then `extra`."""
    return (*DEFAULT_ALLOWED_PREFIXES, *_user_prefixes, *extra)


def is_allowed(path: str, prefixes: Iterable[str]) -> bool:
    """True if `path` falls under one of `prefixes`. A prefix without a trailing dot matches that
    exact name or names below it ('mypkg' allows 'mypkg.x', not 'mypkg_evil.x')."""
    for prefix in prefixes:
        if prefix.endswith("."):
            if path.startswith(prefix):
                return True
        elif path == prefix or path.startswith(prefix + "."):
            return True
    return False


def check_allowed(path: str, extra: Iterable[str] = ()) -> None:
    """Raise `TargetNotAllowedError` (saying how to allow it) unless `path` is allowlisted."""
    prefixes = allowed_prefixes(extra)
    if not is_allowed(path, prefixes):
        top = path.split(".")[0]
        raise TargetNotAllowedError(
            f"import path {path!r} is not in the allowlist {list(prefixes)}",
            f"to allow it, call megatron_bridge.training.config.serialization.allow_target_prefix({top + '.'!r}) "
            f"or pass allowed_prefixes=({top + '.'!r},)",
        )


def import_object(path: str, allowed: Optional[Iterable[str]] = None) -> Any:
    """Import 'pkg.mod.attr' (attributes may nest, e.g. 'signal.Signals.SIGTERM').

    With `allowed` given, the path must also be under the allowlist plus those prefixes.
    Raises ImportError (or TargetNotAllowedError) with the path in the message.
    """
    if not isinstance(path, str) or not path or path.startswith(".") or path.endswith(".") or ".." in path:
        raise ImportError(f"{path!r} is not an import path like 'package.module.name'")
    if allowed is not None:
        check_allowed(path, allowed)
    return _import(path)


@functools.lru_cache(maxsize=1024)
def _import(path: str) -> Any:
    parts = path.split(".")
    # Fast path: the module is already imported (no file-system search for non-modules).
    for cut in range(len(parts) - 1, 0, -1):
        loaded = sys.modules.get(".".join(parts[:cut]))
        if loaded is not None:
            try:
                return functools.reduce(getattr, parts[cut:], loaded)
            except AttributeError:
                break  # perhaps a submodule not imported yet
    module = None
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as exc:
                # Only "this prefix is not a module" means: try a shorter one. A module that exists
                # but fails to import must surface its own error.
                if exc.name is not None and name != exc.name and not name.startswith(exc.name + "."):
                    raise
                module = None
                continue
        break
    if module is None:
        raise ImportError(f"cannot import {path!r}: no module {parts[0]!r}")
    obj = module
    for i in range(cut, len(parts)):
        try:
            obj = getattr(obj, parts[i])
        except AttributeError:
            where = ".".join(parts[:i])
            raise ImportError(f"cannot import {path!r}: {where!r} has no attribute {parts[i]!r}") from None
    return obj


_path_cache: dict[Any, Optional[str]] = {}


def object_path(obj: Any) -> Optional[str]:
    """The import path that gives back `obj` itself (a function, class, dtype or enum member),
    or None if there is none (lambdas, local functions, bound methods, instances)."""
    try:
        return _path_cache[obj]
    except (KeyError, TypeError):
        pass
    path = _find_path(obj)
    try:
        _path_cache[obj] = path
    except TypeError:  # unhashable: not cached
        pass
    return path


def _resolves_to(path: str, obj: Any) -> bool:
    try:
        return _import(path) is obj
    except Exception:  # any failure means: this path does not name obj
        return False


def _find_path(obj: Any) -> Optional[str]:
    import enum

    if isinstance(obj, enum.Enum):
        owner = object_path(type(obj))
        return f"{owner}.{obj.name}" if owner and _resolves_to(f"{owner}.{obj.name}", obj) else None
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    name = qualname.rsplit(".", 1)[-1]
    # torch builtins report private owners (`torch._C._nn`, `_VariableFunctionsClass.relu`).
    public = module.startswith(("torch", "megatron.core")) and ("." not in qualname or not isinstance(obj, type))
    candidates = [f"{ns}.{name}" for ns in _PREFERRED_NAMESPACES] if public else []
    # Prefer the shortest public module that re-exports it (`megatron_bridge.models.GPTModelProvider`)
    # over the defining module, so internal moves do not break saved files.
    parts = module.split(".")
    candidates += [".".join(parts[:cut]) + "." + qualname for cut in range(1, len(parts) + 1)]
    for path in candidates:
        if path.split(".")[0] in sys.modules and _resolves_to(path, obj):
            return path
    return None


def resolve_short_callable(name: str) -> Optional[Any]:
    """A function named without its module (`silu`), looked up in SHORT_NAME_NAMESPACES."""
    if not name.isidentifier() or name.startswith("_"):
        return None
    for ns in SHORT_NAME_NAMESPACES:
        try:
            module = _import(ns)
        except ImportError:
            continue
        obj = getattr(module, name, None)
        if callable(obj) and not isinstance(obj, type(sys)):
            return obj
    return None


@functools.lru_cache(maxsize=1)
def short_callable_names() -> tuple[str, ...]:
    """Every name `resolve_short_callable` knows (for 'did you mean' hints)."""
    names = []
    for ns in SHORT_NAME_NAMESPACES:
        try:
            module = _import(ns)
        except ImportError:
            continue
        names += [n for n in dir(module) if not n.startswith("_") and resolve_short_callable(n) is not None]
    return tuple(names)
