"""The check that every numeric config field holds a value in its range.

Each numeric field's range is part of its `FieldSpec` (`config.schema` says where it is
declared). A value outside its range is a configuration problem that names the range. Lists of
numbers (e.g. `moe_aux_loss_coeff` per layer) are checked item by item.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import Range
from megatron_bridge.config.schema import specs


def numeric_fields(cls: type) -> tuple[tuple[str, Range], ...]:
    """(name, range) of every numeric field of config class `cls`."""
    return tuple((s.name, s.range) for s in specs(cls).values() if s.range is not None)


@functools.lru_cache(maxsize=None)
def _bounds(cls: type) -> tuple[tuple[tuple[str, Any], ...], dict[str, tuple[float, float, bool, bool, Range]]]:
    """For `check`: (name, in-range default) of each numeric field, and by name its range as
    (low, high, low inclusive, high inclusive, range). A missing bound is an infinity excluded,
    so infinities and NaN never pass the comparisons."""
    fields = cls.__dataclass_fields__
    table = numeric_fields(cls)
    defaults = tuple((name, _in_range_default(fields[name].default, rng)) for name, rng in table)
    bounds = {
        name: (
            -math.inf if rng.low is None else rng.low,
            math.inf if rng.high is None else rng.high,
            rng.low is not None and rng.low_inclusive,
            rng.high is not None and rng.high_inclusive,
            rng,
        )
        for name, rng in table
    }
    return defaults, bounds


def _in_range_default(default: Any, rng: Range) -> Any:
    """`default` if it is in `rng` (a value identical to it needs no check), else a marker no
    value is identical to (some megatron-core defaults, like num_layers=0, must be set)."""
    items = default if isinstance(default, (list, tuple)) else (default,)
    if default is dataclasses.MISSING or any(rng.problem(item) for item in items):
        return _NO_DEFAULT
    return default


_NO_DEFAULT = object()


def check(obj: Any, problems: Problems) -> bool:
    """Add a problem for each numeric field of config `obj` outside its range; return whether
    all were in range. A field still holding its in-range class default is not checked again."""
    ok = True
    values = obj.__dict__
    defaults, bounds = _bounds(type(obj))
    for name, default in defaults:  # kept lean: it runs for every numeric field of every section
        value = values.get(name)
        if value is default or value is None:
            continue
        low, high, low_in, high_in, rng = bounds[name]
        kind = value.__class__
        if (kind is int or kind is float) and (
            (low <= value if low_in else low < value) and (value <= high if high_in else value < high)
        ):
            continue  # the common case, without a call: a plain number in range
        for item in value if isinstance(value, (list, tuple)) else (value,):
            why = rng.problem(item)
            if why:
                problems.add(name, why, f"use a value in {rng}" if rng.below else "choose a value in that range")
                ok = False
                break
    return ok
