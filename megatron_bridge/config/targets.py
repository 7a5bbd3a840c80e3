"""The objects a config may name, by exact name.

A config file or an override can name a class (`_target_: ...`) or a function
(`activation_func: silu`). Turning such a name into an object must never run code or reach
anything else, so names resolve only through this registry:

* the project's config classes (registered when the class is created, as are users' subclasses
  of `ConfigBase`, e.g. their `DatasetProvider`s);
* the activation and weight-initialization functions listed below, and torch dtypes;
* whatever code registers with `register_target` (a user's checkpoint manager, layer spec, ...).

There is no import of arbitrary modules and no attribute traversal: `torch.os.system` is not a
registered name, and whatever a name leads to is checked against the registered objects. Nothing
in a config can register anything. Decoding a config calls no registered function either (only
config-class constructors); functions are kept as references or `functools.partial`s.

The built-in names of a module are registered when they are first needed; the module is
imported only to resolve one of them: resolving `silu` does not import megatron-core, and
nothing here imports torch until a torch name is asked for. A package of this project that
exports config classes on first use declares them (`register_lazy_exports`); resolving such a
name imports the packages on its path (their `__init__` only) and the module their table names.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import sys
from typing import Any, Optional

_BY_NAME: dict[str, Any] = {}
"""Registered name -> object."""

_NAME_OF: dict[int, str] = {}
"""id(object) -> its canonical (first registered, or shortest public) name."""

_OBJECTS: dict[int, Any] = {}
"""id(object) -> object: keeps registered objects alive, so their ids stay theirs."""

# Functions configs use, by module; `torch` also gives every torch dtype.
_BUILTINS: dict[str, tuple[str, ...]] = {
    "torch.nn.functional": (
        "gelu", "silu", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "softplus", "sigmoid",
        "tanh", "mish", "hardswish", "hardsigmoid", "hardtanh", "softsign", "logsigmoid", "glu",
    ),
    "torch": ("tanh", "sigmoid", "relu"),
    "torch.nn.init": (
        "normal_", "uniform_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
        "kaiming_normal_", "zeros_", "ones_", "constant_", "orthogonal_",
    ),
    "megatron.core.activations": ("squared_relu", "quick_gelu", "fast_gelu"),
    "signal": ("Signals",),
}  # fmt: skip
_loaded: set[str] = set()
"""Modules of `_BUILTINS` whose names are registered."""

SHORT_NAME_NAMESPACES = ("torch.nn.functional", "megatron.core.activations")
"""Where a function named without its module (`silu`) is looked up, in order."""

_LAZY_EXPORTS: dict[str, dict[str, str]] = {}
"""Package -> {name: the module defining it} of the config classes the package exports on first
use (its module `__getattr__`), as the package declared them (`register_lazy_exports`)."""

_LAZY_PACKAGES = ("megatron_bridge.",)
"""The project's own packages: resolving a name under them may import them (never another module)."""


class TargetNotAllowedError(ImportError):
    """A name that is not registered; `.fix` says how to register it (in code)."""

    def __init__(self, message: str, fix: str):
        super().__init__(f"{message}; {fix}")
        self.message = message
        self.fix = fix


def register_target(obj: Any, name: Optional[str] = None, *, canonical: bool = False) -> Any:
    """Allow configs to name `obj` (a class or function) as `name` (default: its import path,
    `module.qualname`). Returns `obj`, so it works as a decorator. Call it from code, e.g. next to
    the class; a config cannot call it. With `canonical`, configs are written with `name` too (a
    class's public import path, which stays when the module defining it moves)."""
    if name is None:
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
            raise ValueError(f"register_target: {obj!r} has no import path; pass name='pkg.mod.Name'")
        name = f"{module}.{qualname}"
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"register_target: {name!r} is not a dotted name like 'pkg.mod.Name'")
    _BY_NAME[name] = obj
    if canonical:
        _NAME_OF[id(obj)] = name
    else:
        _NAME_OF.setdefault(id(obj), name)
    _OBJECTS[id(obj)] = obj
    return obj


def register_lazy_exports(package: str, names: dict[str, str]) -> None:
    """Declare that `package` exports the config classes `names` (name -> the module defining it)
    on first use. Configs may then name one as `package.Name` or `module.Name` before anything
    imported it: resolving the name imports that module, which registers its classes. Called by
    the package itself, when it is imported."""
    _LAZY_EXPORTS.setdefault(package, {}).update(names)


def register_config_class(cls: type) -> None:
    """Called for every `ConfigBase` subclass when it is created (see config.base)."""
    qualname = cls.__qualname__
    if "<" not in qualname:  # classes defined inside functions have no import path
        register_target(cls, f"{cls.__module__}.{qualname}")


def _builtin_module(name: str) -> Optional[str]:
    """The `_BUILTINS` module that `name` (`module.function`, a torch dtype, an enum member) would
    come from, or None."""
    for module_name, names in _BUILTINS.items():
        rest = name[len(module_name) + 1 :] if name.startswith(module_name + ".") else ""
        if rest.split(".")[0] in names or (module_name == "torch" and rest.isidentifier()):
            return module_name
    return None


def _load_builtins(module_name: str, import_it: bool = False) -> None:
    """Register the built-in names of `_BUILTINS` module `module_name` if it is imported (after
    importing it, with `import_it`); until then, no object from it can exist."""
    module = sys.modules.get(module_name)
    if module_name in _loaded or (module is None and not import_it):
        return
    _loaded.add(module_name)
    try:
        module = module or importlib.import_module(module_name)
    except ImportError:  # megatron-core missing: its activations are simply not available
        return
    for name in _BUILTINS[module_name]:
        if callable(getattr(module, name, None)):
            register_target(getattr(module, name), f"{module_name}.{name}")
    if module_name == "torch":
        for name in sorted(n for n, v in vars(module).items() if type(v) is module.dtype):
            register_target(getattr(module, name), f"torch.{name}")


def is_registered(obj: Any) -> bool:
    """Whether `obj` itself is a registered object."""
    if len(_loaded) < len(_BUILTINS):
        for module_name in _BUILTINS:
            _load_builtins(module_name)
    return _OBJECTS.get(id(obj)) is obj


def resolve(name: Any) -> Any:
    """The registered object called `name`; `TargetNotAllowedError` (with the closest registered
    names) if there is none. Also accepts a config class's public re-export
    (`megatron_bridge.training.config.TrainingConfig`) and members of registered enums."""
    if not isinstance(name, str) or not name or not all(p.isidentifier() for p in name.split(".")):
        raise TargetNotAllowedError(f"{str(name)[:80]!r} is not a dotted name", "use e.g. 'torch.nn.init.normal_'")
    module_name = _builtin_module(name)
    if module_name is not None:
        _load_builtins(module_name, import_it=True)
    obj = _BY_NAME.get(name)
    if obj is None:
        obj = _public_alias(name)
    if obj is None:
        import difflib  # only for the hint of an error: `import megatron_bridge` stays light

        hint = difflib.get_close_matches(name, _public_names(), n=3, cutoff=0.6)
        closest = f" (closest: {', '.join(hint)})" if hint else ""
        raise TargetNotAllowedError(
            f"{name!r} is not a name configs may use{closest}",
            "configs may only name registered classes and functions; register yours in code with "
            "megatron_bridge.config.targets.register_target(obj)",
        )
    return obj


def _public_names() -> list[str]:
    """Every registered name configs may use (torch dtypes aside), for 'closest' hints.

    Looking up a public name may register more objects (built-in names of a module imported
    meanwhile, classes of a lazily exported module), so the objects are listed first and the
    registry is never iterated while it can change."""
    dtype = sys.modules["torch"].dtype if "torch" in sys.modules else ()
    objects = [o for o in list(_OBJECTS.values()) if not isinstance(o, dtype)]
    names = {name_of(o) for o in objects} | set(_builtin_names())
    return sorted(n for n in names if n)


def _exported(module_name: str, attr: str) -> Any:
    """Attribute `attr` of module `module_name` if that module is imported (a lazily exported
    project class is imported by its package), else None."""
    module = sys.modules.get(module_name)
    if module is None:
        return None
    found = module.__dict__.get(attr)
    if found is None and attr in _LAZY_EXPORTS.get(module_name, {}):
        found = getattr(module, attr, None)
    return found


def _import_packages(module_name: str) -> None:
    """Import the project's packages on the path of `module_name` (each package's `__init__`,
    stopping at the first name that is not a package: no module is run), so that what they
    export lazily is declared."""
    parts = module_name.split(".")
    for cut in range(1, len(parts) + 1):
        package = ".".join(parts[:cut])
        if package not in sys.modules:
            try:
                spec = importlib.util.find_spec(package)
            except (ImportError, ValueError):
                return
            if spec is None or spec.submodule_search_locations is None:
                return
            importlib.import_module(package)
        if not hasattr(sys.modules[package], "__path__"):
            return


def _public_alias(name: str) -> Any:
    """`pkg.Name` where an imported `pkg` re-exports a registered object (checked: the object
    found must be registered), or `Enum.MEMBER` of a registered enum class. One attribute lookup
    on an imported module; the only imports are the project's packages on the name's path and the module a package's lazy table names for it
    (`register_lazy_exports`)."""
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        return None
    owner = _BY_NAME.get(module_name)
    if isinstance(owner, type) and issubclass(owner, enum.Enum):
        return owner.__members__.get(attr)
    if name.startswith(_LAZY_PACKAGES):
        _import_packages(module_name)
        for package, names in list(_LAZY_EXPORTS.items()):
            defining = names.get(attr)
            if defining is not None and module_name in (package, defining):
                importlib.import_module(defining)  # registers its classes
                if name in _BY_NAME:
                    return _BY_NAME[name]
    candidate = _exported(module_name, attr)
    return candidate if candidate is not None and is_registered(candidate) else None


def name_of(obj: Any) -> Optional[str]:
    """The name under which `obj` can be written into a config (and resolved back), or None if it
    is not registered. Classes get their shortest public path (`megatron_bridge.models.X` rather
    than the defining module), so internal moves do not break saved files."""
    if isinstance(obj, enum.Enum):
        owner = name_of(type(obj))
        if owner is None:
            register_target(type(obj))  # enums used in config values are data, not code
            owner = name_of(type(obj))
        return f"{owner}.{obj.name}" if owner else None
    if not is_registered(obj):
        return None
    name = _NAME_OF[id(obj)]
    if isinstance(obj, type) and name.startswith(_LAZY_PACKAGES):
        parts = name.split(".")
        for cut in range(1, len(parts) - 1):
            if _exported(".".join(parts[:cut]), parts[-1]) is obj:
                _NAME_OF[id(obj)] = shorter = ".".join(parts[:cut]) + "." + parts[-1]
                return shorter
    return name


def resolve_short_callable(name: str) -> Optional[Any]:
    """A registered function named without its module (`silu`), looked up in
    SHORT_NAME_NAMESPACES; None if there is none."""
    if not name.isidentifier():
        return None
    for namespace in SHORT_NAME_NAMESPACES:
        if name in _BUILTINS[namespace]:
            _load_builtins(namespace, import_it=True)
        obj = _BY_NAME.get(f"{namespace}.{name}")
        if obj is not None:
            return obj
    return None


def short_callable_names() -> tuple[str, ...]:
    """Every name `resolve_short_callable` knows (for 'did you mean' hints)."""
    prefixes = tuple(ns + "." for ns in SHORT_NAME_NAMESPACES)
    return tuple(sorted({n.rsplit(".", 1)[1] for n in [*_BY_NAME, *_builtin_names()] if n.startswith(prefixes)}))


def _builtin_names() -> list[str]:
    """The names of `_BUILTINS` functions, known without importing their modules (for hints)."""
    return [f"{module_name}.{name}" for module_name, names in _BUILTINS.items() for name in names]
