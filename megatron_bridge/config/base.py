"""What every config class shares.

* **Which fields the user set.** A field counts as the user's once it is passed to the constructor
  or assigned afterwards (in a recipe, a script, from YAML or an override), even when the value
  equals the default. Presets consult this and never overwrite such a field.
* **Type-checked assignment.** A value the user sets must fit the field's declared type; a string
  where an int is declared raises `TypeError` at once.
* **Deferred finalize.** Subclasses of megatron-core configs do nothing in `__post_init__`; their
  checks and derived values run in `finalize()`, so recipes and overrides can edit fields first.
* **Derived values stay fresh.** When `finalize()` fills in a field, the previous
  value is remembered; the next `finalize()` puts it back before any section code runs, so editing
  `hidden_size` after a finalize does not leave a stale `ffn_hidden_size` behind. A field the user
  sets explicitly is never put back.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import traceback
from abc import ABCMeta
from typing import Any, ClassVar, Optional

from megatron_bridge.config import paths, ranges, schema, status
from megatron_bridge.config.annotations import field_types, type_problem, values_equal
from megatron_bridge.config.errors import ConfigValidationError, Problems, show
from megatron_bridge.config.fields import field  # noqa: F401 (config classes declare fields with it)
from megatron_bridge.config.targets import register_target

# Bookkeeping lives in the instance __dict__ under these names (not dataclass fields), so it is
# carried by copy.deepcopy and pickle but ignored by dataclasses.fields/asdict/replace.
_EXPLICIT = "_mb_explicit"
_DERIVED = "_mb_derived"
_TRACKING = "_mb_tracking"
_RECORDING = "_mb_recording"  # while megatron-core's __post_init__ runs: field -> value before it

_READ_ONLY = "_mb_read_only"
_FINALIZED = "_mb_finalized"  # the last finalize found no problem
_MISSING = object()


def set_read_only(cfg: Any, read_only: bool) -> None:
    """Make `cfg` and the config objects it holds (its sections) read-only, or writable again:
    while read-only, changing a field or recording a derived value raises `RuntimeError` naming
    it. New config objects (a check may build one to compare against) stay writable."""
    for d in [cfg.__dict__, *(v.__dict__ for v in vars(cfg).values() if is_config(v))]:
        if read_only:
            d[_READ_ONLY] = True
        else:
            d.pop(_READ_ONLY, None)


def is_config(value: Any) -> bool:
    """`isinstance(value, ConfigBase)`, without ABCMeta's slower instance check (hot paths)."""
    return isinstance(type(value), _ConfigMeta)


def _refuse_change(obj: Any, name: str) -> None:
    raise RuntimeError(f"{type(obj).__name__}.{name} changed while the config is read-only (during a check)")


class _ConfigMeta(ABCMeta):
    """Registers each config class as a name configs may use; records which constructor
    arguments the caller passed, then turns on tracking."""

    def __init__(cls, name: str, bases: tuple, namespace: dict, **kwargs: Any) -> None:
        super().__init__(name, bases, namespace, **kwargs)
        if "<" not in cls.__qualname__:  # classes defined inside functions have no import path
            register_target(cls)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if args:  # named like keyword arguments, so they are type-checked and tracked the same way
            names = cls._positional_fields
            if names is None:
                params = inspect.signature(cls.__init__).parameters.values()
                names = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)[1:]  # after self
            if not names:
                raise TypeError(f"{cls.__name__} takes keyword arguments only, got {len(args)} positional")
            if len(args) > len(names):
                allowed = f"at most {len(names)} positional arguments {names}"
                raise TypeError(f"{cls.__name__} takes {allowed}, got {len(args)}")
            for name, value in zip(names, args):
                if name in kwargs:
                    raise TypeError(f"{cls.__name__}: got {name!r} both as positional and keyword argument")
                kwargs[name] = value
        for alias, target in cls._field_aliases.items():
            if alias in kwargs:
                if target in kwargs:
                    raise TypeError(f"{cls.__name__}: pass either {alias!r} or {target!r}, not both")
                kwargs[target] = kwargs.pop(alias)
        for name, value in kwargs.items():
            why = type_problem(cls, name, value)  # None for a name that is no field
            if why:
                raise TypeError(f"{cls.__name__}.{name}: {why}")
        obj = super().__call__(**kwargs)
        obj.__dict__.update({_EXPLICIT: {k for k in kwargs if k in field_types(cls)}, _TRACKING: True})
        obj.__dict__.setdefault(_DERIVED, {})
        return obj


class ConfigBase(metaclass=_ConfigMeta):
    """Base of every config dataclass in megatron_bridge (see the module docstring)."""

    _field_aliases: ClassVar[dict[str, str]] = {}
    """Alternative constructor/override names for fields, e.g. `seq_length` for `sequence_length`."""

    _moved_fields: ClassVar[dict[str, str]] = {}
    """Fields that moved into a section: the old key -> "section.field". A config saved with the
    old key still loads (see `serialization`)."""

    _positional_fields: ClassVar[Optional[tuple[str, ...]]] = None
    """The names positional constructor arguments stand for, in order (None: the dataclass's)."""

    # ------------------------------------------------------------------ user-set fields
    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        if _READ_ONLY in d:
            _refuse_change(self, name)
        if d.get(_TRACKING) and name in field_types(type(self)):
            why = type_problem(type(self), name, value)
            if why:
                raise TypeError(f"{type(self).__name__}.{name}: {why}")
            object.__setattr__(self, name, value)
            d[_EXPLICIT].add(name)
            d[_DERIVED].pop(name, None)
            if name[0] != "_":  # a setting, not megatron-core's runtime state: derived values may be stale now
                d.pop(_FINALIZED, None)
            return
        aliased = type(self)._field_aliases.get(name)
        if aliased is not None:
            setattr(self, aliased, value)
            return
        if d.get(_TRACKING) and not name.startswith("_") and not hasattr(type(self), name):
            raise AttributeError(unknown_field_message(type(self), name))
        recording = d.get(_RECORDING)
        if recording is not None and name not in recording:
            recording[name] = d.get(name, _MISSING)
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        """Reading a field by its alias (only called when normal lookup fails)."""
        aliased = type(self)._field_aliases.get(name)
        if aliased is not None:
            return getattr(self, aliased)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def is_explicit(self, name: str) -> bool:
        """True if the user set `name` (constructor, assignment, YAML or override)."""
        return name in self.__dict__.get(_EXPLICIT, ())

    def explicit_fields(self) -> frozenset[str]:
        return frozenset(self.__dict__.get(_EXPLICIT, ()))

    def mark_explicit(self, name: str, explicit: bool = True) -> None:
        """Record (or forget) that the user set `name`; used when loading configs from files."""
        names = self.__dict__.setdefault(_EXPLICIT, set())
        if explicit:
            names.add(name)
            self.__dict__.setdefault(_DERIVED, {}).pop(name, None)
        else:
            names.discard(name)

    def apply_default(self, name: str, value: Any) -> None:
        """Set a value the framework chose (a preset, a recipe-independent default): it does not
        count as the user's, and finalize keeps it."""
        d = self.__dict__
        if _READ_ONLY in d:
            _refuse_change(self, name)
        d.setdefault(_DERIVED, {}).pop(name, None)  # kept by finalize
        object.__setattr__(self, name, value)

    def _derive(self, name: str, value: Any) -> None:
        """Set a value computed by `finalize()` from other fields. The value it replaces is
        remembered and put back by the next finalize, which then recomputes it."""
        d = self.__dict__
        if _READ_ONLY in d:
            _refuse_change(self, name)
        d.setdefault(_DERIVED, {}).setdefault(name, d.get(name, _MISSING))  # the first value it replaced
        object.__setattr__(self, name, value)

    def derived_fields(self) -> frozenset[str]:
        return frozenset(self.__dict__.get(_DERIVED, ()))

    def _restore_derived(self) -> None:
        """Put back what finalize/presets replaced, so derived values are recomputed."""
        derived = self.__dict__.get(_DERIVED, {})
        for name, before in derived.items():
            if before is _MISSING:  # an init=False field that lived on the class until derived
                self.__dict__.pop(name, None)
            else:
                object.__setattr__(self, name, before)
        derived.clear()

    def _run_parent_post_init(self, parent: type, problems: Problems) -> None:
        """Run a megatron-core parent's `__post_init__` on this object, recording what it derived.

        megatron-core reports bad values with `ValueError`/`AssertionError` on the first one it
        meets; those become a problem on this section instead of an unstructured crash.
        """
        d = self.__dict__
        before: dict[str, Any] = {}
        tracking, d[_TRACKING], d[_RECORDING] = d.get(_TRACKING, False), False, before
        try:
            parent.__post_init__(self)
        except (ValueError, AssertionError, TypeError, NotImplementedError) as exc:
            frames = traceback.extract_tb(exc.__traceback__)  # for bare asserts: the line that failed
            line = f" at `{frames[-1].line}`" if frames and frames[-1].line else ""
            message = str(exc).strip() or f"{type(exc).__name__}{line}"
            name = self._field_named_in(message)
            if name is None:
                problems.add("", f"megatron-core rejects this {parent.__name__}: {message}", "change the fields it names")
            else:
                value = show(d.get(name))
                problems.add(name, f"{value} is rejected by megatron-core's {parent.__name__}: {message}",
                             f"change {name}, or the other fields the message names")  # fmt: skip
        finally:
            d[_TRACKING] = tracking
            del d[_RECORDING]
        derived = d.setdefault(_DERIVED, {})
        names = field_types(type(self))
        for k, old in before.items():
            if k in names and k not in derived and d.get(k, _MISSING) is not old:
                derived[k] = old

    def _field_named_in(self, message: str) -> Optional[str]:
        """The field a megatron-core message is about: of the fields it names (`fp8_param`, or a
        Megatron-LM flag `--moe-router-pre-softmax`), the first the user set, else the first."""
        fields = field_types(type(self))
        named = [w.lstrip("-").replace("-", "_") for w in re.findall(r"-*[A-Za-z_][\w-]*", message)]
        named = [n for n in dict.fromkeys(named) if n in fields]
        return next((n for n in named if self.is_explicit(n)), named[0] if named else None)

    def __copy__(self) -> Any:
        clone, d = object.__new__(type(self)), self.__dict__
        clone.__dict__.update(d, **{_EXPLICIT: set(d.get(_EXPLICIT, ())), _DERIVED: dict(d.get(_DERIVED, {}))})
        clone.__dict__.pop(_READ_ONLY, None)  # a copy is a new object: writable
        return clone

    # ------------------------------------------------------------------ finalize
    def _finalize(self, problems: Problems) -> None:
        """Checks and derived values of this section, reported into `problems` (subclasses override
        it). What the previous finalize derived is put back first, so it is recomputed."""

    def finalize(self) -> None:
        """Check this config and compute its derived values. Idempotent; raises
        `ConfigValidationError` listing every problem found."""
        problems = Problems()
        finalize_into(self, problems)
        problems.raise_if_any()

    def is_finalized(self) -> bool:
        """Whether the last `finalize()` (or validation of a container holding it) succeeded."""
        return bool(self.__dict__.get(_FINALIZED))

    # ------------------------------------------------------------------ equality
    def __eq__(self, other: Any) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(values_equal(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self))

    __hash__ = None  # type: ignore[assignment]


schema.CONFIG_BASE = ConfigBase  # the schema tells our classes from megatron-core's by it


def unknown_field_message(cls: type, name: str) -> str:
    """`cls` has no field `name`: the message names the closest fields (a typo is never silent)."""
    import difflib

    names = sorted({*field_types(cls), *cls._field_aliases})
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    initials = "".join(part[:1] for part in name.split("_"))  # learning_rate -> lr
    close += [n for n in names if n == initials and n not in close]
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"{cls.__name__} has no field {name!r}{hint}"


def config_dataclass(cls: type | None = None, /, **kwargs: Any) -> Any:
    """`@dataclass` for config classes: keeps `ConfigBase.__eq__` (which understands partials)."""

    def wrap(klass: type) -> type:
        klass = dataclasses.dataclass(klass, eq=False, **kwargs)
        # A megatron-core parent brings a generated __eq__ that sees only its own fields and
        # compares partials by identity; ours compares every field.
        klass.__eq__ = ConfigBase.__eq__
        klass.__hash__ = None
        return klass

    return wrap if cls is None else wrap(cls)


def finalize_into(config: Any, problems: Problems) -> None:
    """Finalize `config` (ours, or any object with `finalize()`), collecting its problems."""
    if is_config(config):
        # Out-of-range numbers are reported alone: the section's own checks and megatron-core's
        # derivations would only trip over them (divide by zero, overflow) with worse messages.
        config._restore_derived()
        before = len(problems)
        paths.check(config, problems)
        if ranges.check(config, problems):
            config._finalize(problems)
        status.check_unsupported(config, problems)
        config.__dict__[_FINALIZED] = len(problems) == before
        return
    finalize = getattr(config, "finalize", None)
    if callable(finalize):
        try:
            finalize()
        except ConfigValidationError as exc:
            problems.absorb(exc)
        except (ValueError, AssertionError, TypeError) as exc:
            problems.add("", str(exc), "fix the fields it names")
