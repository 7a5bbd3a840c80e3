"""What each config field does at run time: **used**, **derived**, or **unsupported** (with why).

* **used**: the runtime reads it (our code, or megatron-core, which receives the fields our
  classes inherit from its config classes).
* **derived**: a rule computes it from other fields (`init=False` fields); users do not set it.
* **unsupported**: accepted for compatibility with configs written for other systems, but not
  honoured here. Setting it to anything but its default is a `ConfigValidationError` naming the
  reason. Reasons about the machine ("needs a GPU", "needs TransformerEngine") are not config
  errors: a dry run plans such a config and reports "would fail on this machine"; the real run
  refuses it before building the model (`machine_problems`).

Where a status is declared: `config.schema`. `docs/unsupported-fields.md` lists the unsupported
fields (`tools/gen_unsupported_fields.py` writes it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, Optional

from megatron_bridge import extras
from megatron_bridge.config.annotations import values_equal
from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError, Problems
from megatron_bridge.config.fields import DERIVED, USED, Unsupported  # noqa: F401
from megatron_bridge.config import schema
from megatron_bridge.config.schema import Status, specs

GENERIC_MCORE_TEST = "tests/test_field_status.py::test_megatron_core_fields_reach_megatron_core"
"""The test that shows fields inherited from megatron-core reach the megatron-core object."""


# ---------------------------------------------------------------------- lookups
def from_megatron_core(cls: type, name: str) -> bool:
    """True if `name` is a field of a megatron-core dataclass that `cls` inherits from."""
    return specs(cls)[name].core_owner is not None


def status_of(cls: type, name: str) -> Status:
    """The status of field `name` of config class `cls`."""
    return specs(cls)[name].status


def unsupported_class(cls: type) -> Optional[Unsupported]:
    """Why config class `cls` cannot be used at all (the run would silently do something else), or None."""
    return getattr(cls, "unsupported_reason", None)


def __getattr__(name: str) -> Any:
    if name == "UNSUPPORTED":  # a view for listings and tests: the declarations sit on the fields
        from megatron_bridge.config.field_catalog import declared_fields

        table: dict[str, dict[str, Unsupported]] = {}
        for (owner, field_name), (_, status) in declared_fields().items():
            if isinstance(status, Unsupported):
                table.setdefault(owner, {})[field_name] = status
        return table
    raise AttributeError(name)


@functools.cache
def _unsupported_fields(cls: type, refused_only: bool = False) -> tuple[tuple[str, Any, Unsupported], ...]:
    """(name, default, why) of each unsupported field of `cls` (dataclasses.MISSING when the
    field has no default); with `refused_only`, those whose reason is not the machine."""
    return tuple(
        (s.name, s.default, s.status)
        for s in specs(cls).values()
        if isinstance(s.status, Unsupported) and not (refused_only and s.status.needs)
    )


def _changed(config: Any, fields: tuple[tuple[str, Any, Unsupported], ...]) -> Iterator[tuple[str, Any, Unsupported]]:
    values = config.__dict__
    for name, default, why in fields:
        value = values.get(name, default)
        if value is not default and (default is dataclasses.MISSING or not values_equal(value, default)):
            yield name, value, why


def unsupported_settings(config: Any) -> Iterator[tuple[str, Any, Unsupported]]:
    """(field, value, why) for each unsupported field of `config` set to a non-default value,
    and ("", class name, why) when the class itself is unsupported."""
    cls = type(config)
    why = unsupported_class(cls)
    if why is not None:
        yield "", cls.__name__, why
    yield from _changed(config, _unsupported_fields(cls))


def check_unsupported(config: Any, problems: Problems) -> None:
    """Report unsupported settings of one section into `problems` (machine reasons excepted)."""
    cls = type(config)
    refused = _unsupported_fields(cls, True)
    why = unsupported_class(cls)
    if why is not None and why.needs is None:
        problems.add("", f"{cls.__name__} is not supported: {why.reason}", "use another config class")
    if refused:  # most classes have none: no generator for them (this runs for every section)
        for name, value, why in _changed(config, refused):
            problems.add(name, f"{name}={value!r} is not supported: {why.reason}", "leave it at its default")


def machine_problems(cfg: Any, device: Optional[str] = None) -> list[str]:
    """Settings of `cfg` this machine cannot run (no GPU, no TransformerEngine), as messages.
    `device`: where the run trains ("cpu" also on a machine with GPUs); default: a GPU if any."""
    return [str(p) for p in _machine_problems(cfg, device)]


def refuse_on_this_machine(cfg: Any, device: Optional[str] = None) -> None:
    """Raise `ConfigValidationError` listing the settings this machine cannot run (on `device`)."""
    found = _machine_problems(cfg, device)
    if found:
        raise ConfigValidationError(found)


def _machine_problems(cfg: Any, device: Optional[str]) -> list[ConfigProblem]:
    import torch

    has_gpu = torch.cuda.is_available()
    on_gpu = has_gpu if device is None else device == "cuda"
    found = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name, None)
        if not isinstance(section, schema.CONFIG_BASE):
            continue
        for name, value, why in unsupported_settings(section):
            if why.needs == "transformer_engine" and not extras.is_installed("transformer_engine"):
                fix = "pip install transformer-engine, or leave it unset"
            elif why.needs == "gpu" and not on_gpu:
                where = "train on the GPUs (dist.distributed_backend=auto or nccl)" if has_gpu else "run on a machine with a GPU"
                fix = f"{where}, or leave it unset"
            else:
                continue
            found.append(ConfigProblem(f"{f.name}.{name}", f"{name}={value!r} {why.reason}", fix))
    return found
