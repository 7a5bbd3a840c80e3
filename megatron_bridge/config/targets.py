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

The built-in names of a module are registered when the module is imported, which happens only
to resolve a name under it: resolving `silu` does not import megatron-core, and nothing here
imports torch until a torch name is asked for. A package of this project that exports config
classes on first use declares them (`register_lazy_exports`); resolving such a name imports the
packages on its path (their `__init__` only) and the module their table names.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import sys
from typing import Any, Optional

_BY_NAME: dict[str, Any] = {}
"""Registered name -> object."""

_REGISTERED: dict[int, tuple[Any, str]] = {}
"""id(object) -> the object (kept alive, so its id stays its own) and its canonical name (the
first registered, or the shortest public one)."""

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
_BUILTIN_NAMES = [f"{module}.{name}" for module, names in _BUILTINS.items() for name in names]
_loaded: set[str] = set()
"""Modules of `_BUILTINS` whose names are registered."""

SHORT_NAME_NAMESPACES = ("torch.nn.functional", "megatron.core.activations")
"""Where a function named without its module (`silu`) is looked up, in order."""

REFERENCE_PACKAGE = "megatron.bridge"
"""The package of NVIDIA Megatron Bridge, whose config files this project reads: they name our
classes under it (`megatron.bridge.training.config.TrainingConfig`)."""

REFERENCE_DEFAULTS = frozenset({f"{REFERENCE_PACKAGE}.models.gpt_provider.default_layer_spec"})
"""Functions Megatron Bridge writes as a field's default where ours is None."""

_LAZY: dict[str, str] = {}
"""`package.Name` and `module.Name` of a config class a package exports on first use (its module
`__getattr__`) -> the module defining it (`register_lazy_exports`)."""


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
    if canonical or id(obj) not in _REGISTERED:
        _REGISTERED[id(obj)] = (obj, name)
    return obj


def register_lazy_exports(package: str, names: dict[str, str]) -> None:
    """Declare that `package` exports the config classes `names` (name -> the module defining it)
    on first use, so that configs may name one as `package.Name` or `module.Name` before anything
    imported it. Called by the package itself, when it is imported."""
    for name, module in names.items():
        _LAZY[f"{package}.{name}"] = _LAZY[f"{module}.{name}"] = module


def _load_builtins(module_name: str, import_it: bool = False) -> None:
    """Register the names `_BUILTINS` lists for `module_name` once it is imported (importing it
    first, with `import_it`); until then, no object from it can exist."""
    if module_name in _loaded or (sys.modules.get(module_name) is None and not import_it):
        return
    _loaded.add(module_name)
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # megatron-core missing: its activations are simply not available
        return
    names = [name for name in _BUILTINS[module_name] if callable(getattr(module, name, None))]
    if module_name == "torch":
        names += sorted(name for name, value in vars(module).items() if type(value) is module.dtype)
    for name in names:
        register_target(getattr(module, name), f"{module_name}.{name}")


def is_registered(obj: Any) -> bool:
    """Whether `obj` itself is a registered object."""
    if len(_loaded) < len(_BUILTINS):
        for module_name in _BUILTINS:
            _load_builtins(module_name)
    return id(obj) in _REGISTERED  # no other live object has the id of a registered one


def resolve(name: Any) -> Any:
    """The registered object called `name`; `TargetNotAllowedError` (with the closest registered
    names) if there is none."""
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
        raise TargetNotAllowedError(f"{str(name)[:80]!r} is not a dotted name", "use e.g. 'torch.nn.init.normal_'")
    obj = _lookup(name)
    if obj is None:
        import difflib  # only for the hint of an error: `import megatron_bridge` stays light

        # name_of may register objects (enum classes, built-ins): list the objects before it runs
        dtype = sys.modules["torch"].dtype if "torch" in sys.modules else ()
        known = {name_of(o) for o, _ in list(_REGISTERED.values()) if not isinstance(o, dtype)}
        hint = difflib.get_close_matches(name, sorted(known.union(_BUILTIN_NAMES)), n=3, cutoff=0.6)
        closest = f" (closest: {', '.join(hint)})" if hint else ""
        raise TargetNotAllowedError(
            f"{name!r} is not a name configs may use{closest}",
            "configs may only name registered classes and functions; register yours in code with "
            "megatron_bridge.config.targets.register_target(obj)",
        )
    return obj


def _lookup(name: str) -> Any:
    """The registered object `name` leads to, else None: a registered name, `Enum.MEMBER` of a
    registered enum, `pkg.Name` where an imported `pkg` re-exports a registered object, or a name
    under `REFERENCE_PACKAGE` (ours at the same path, else our one object of that name). Imports
    only the project's packages on the path (not its modules) and what a lazy export names."""
    for module_name in _BUILTINS:
        if name.startswith(module_name + "."):
            _load_builtins(module_name, import_it=True)
    obj = _BY_NAME.get(name)
    if obj is not None:
        return obj
    module_name, _, attr = name.rpartition(".")
    owner = _BY_NAME.get(module_name)
    if isinstance(owner, type) and issubclass(owner, enum.Enum):
        obj = owner.__members__.get(attr)
    else:
        if name.startswith("megatron_bridge."):
            parts = module_name.split(".")
            for cut in range(1, len(parts) + 1):
                try:
                    spec = importlib.util.find_spec(".".join(parts[:cut]))
                except (ImportError, ValueError):
                    break
                if spec is None or spec.submodule_search_locations is None:
                    break
                importlib.import_module(spec.name)
            if name in _LAZY:
                importlib.import_module(_LAZY[name])  # registers its classes
        found = _exported(module_name, attr)
        obj = found if found is not None and is_registered(found) else None
    if obj is None and name.startswith(REFERENCE_PACKAGE + "."):
        obj = _lookup("megatron_bridge" + name[len(REFERENCE_PACKAGE) :])
        if obj is None:
            ours = sorted(n for n in [*_BY_NAME, *_LAZY] if n.startswith("megatron_bridge.") and n.endswith("." + attr))
            found = {id(o): o for o in map(_lookup, ours) if o is not None}
            obj = next(iter(found.values())) if len(found) == 1 else None
    return obj


def _exported(module_name: str, attr: str) -> Any:
    """Attribute `attr` of module `module_name` if that module is imported (a class its package
    exports lazily is imported by the package), else None."""
    module = sys.modules.get(module_name)
    if module is None:
        return None
    if f"{module_name}.{attr}" in _LAZY:
        return getattr(module, attr, None)
    return vars(module).get(attr)


def name_of(obj: Any) -> Optional[str]:
    """The name under which `obj` can be written into a config (and resolved back), or None if it
    is not registered. Classes get their shortest public path (`megatron_bridge.models.X` rather
    than the defining module), so internal moves do not break saved files."""
    if isinstance(obj, enum.Enum):
        if not is_registered(type(obj)):
            register_target(type(obj))  # enums used in config values are data, not code
        return f"{name_of(type(obj))}.{obj.name}"
    if not is_registered(obj):
        return None
    name = _REGISTERED[id(obj)][1]
    if isinstance(obj, type) and name.startswith("megatron_bridge."):
        parts = name.split(".")
        for cut in range(1, len(parts) - 1):
            package = ".".join(parts[:cut])
            if _exported(package, parts[-1]) is obj:
                name = f"{package}.{parts[-1]}"
                _REGISTERED[id(obj)] = (obj, name)
                break
    return name


def resolve_short_callable(name: str) -> Optional[Any]:
    """A registered function named without its module (`silu`), looked up in
    SHORT_NAME_NAMESPACES; None if there is none."""
    for namespace in SHORT_NAME_NAMESPACES:
        if name in _BUILTINS[namespace]:
            _load_builtins(namespace, import_it=True)
        if f"{namespace}.{name}" in _BY_NAME:
            return _BY_NAME[f"{namespace}.{name}"]
    return None


def short_callable_names() -> tuple[str, ...]:
    """Every name `resolve_short_callable` knows (for 'did you mean' hints)."""
    prefixes = tuple(namespace + "." for namespace in SHORT_NAME_NAMESPACES)
    return tuple(sorted({n.rsplit(".", 1)[1] for n in [*_BY_NAME, *_BUILTIN_NAMES] if n.startswith(prefixes)}))
