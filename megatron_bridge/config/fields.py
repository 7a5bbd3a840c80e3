"""What a config class declares about a field beyond its type and default: the numbers it allows
(`Range`) and whether the run honours it (its status: used, derived or unsupported, as
`config.status` explains). Both sit next to the field:

    num_workers: int = field(default=2, range=COUNT)
    lazy_mpu_init: bool = field(default=False, status=Unsupported("not implemented"))

Fields inherited from megatron-core are declared in `config.megatron_core_fields`. `config.schema`
compiles both into one `FieldSpec` per class and field.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from megatron_bridge.config.errors import show

RANGE, STATUS = "mb_range", "mb_status"
"""Keys of the field metadata `field` writes."""

USED = "used"
DERIVED = "derived"


@dataclass(frozen=True)
class Unsupported:
    """A field that is accepted but not honoured; `reason` says why (and what to use instead)."""

    reason: str
    needs: Optional[str] = None
    """`"gpu"` or `"transformer_engine"` when only the machine is missing; None otherwise."""


@dataclass(frozen=True)
class Range:
    """Numbers from `low` to `high` (each inclusive or not; `None` is unbounded), and the values
    in `also`. NaN and infinities are never in a range. `below` replaces the message for a value
    under `low` ("the rank must be positive"), where a bare interval would read oddly."""

    low: Optional[float]
    high: Optional[float]
    low_inclusive: bool = True
    high_inclusive: bool = False
    also: tuple = ()
    below: str = ""

    def __str__(self) -> str:
        lo = "-inf" if self.low is None else _num(self.low)
        hi = "inf" if self.high is None else _num(self.high)
        opening = "[" if self.low_inclusive and self.low is not None else "("
        closing = "]" if self.high_inclusive and self.high is not None else ")"
        return "".join(f"{_num(v)} or " for v in self.also) + f"{opening}{lo}, {hi}{closing}"

    def problem(self, value: Any) -> Optional[str]:
        """Why `value` is outside this range, or None (non-numbers are the type check's)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"{value!r} is not a finite number (the allowed range is {self})"
        above_low = self.low is None or value > self.low or (value == self.low and self.low_inclusive)
        below_high = self.high is None or value < self.high or (value == self.high and self.high_inclusive)
        if value in self.also or (above_low and below_high):
            return None
        if self.below and self.low is not None and value <= self.low:
            return f"{self.below}, got {show(value)}"
        return f"{show(value)} is outside the allowed range {self}"


def _num(x: float) -> str:
    for power in (63, 31, 32, 64):
        if x == 2**power:
            return f"2**{power}"
    return str(int(x)) if float(x).is_integer() else repr(x)


def parse(spec: str, also: tuple = (), below: str = "") -> Range:
    """`"[0, 1]"`, `"(0, inf)"`, `"[1, 2**31)"`, ... as a Range."""
    m = re.fullmatch(r"\s*([\[(])\s*([^,]+?)\s*,\s*([^,]+?)\s*([\])])\s*", spec)
    if not m:
        raise ValueError(f"bad range {spec!r}")

    def bound(text: str) -> Optional[float]:
        if text in ("inf", "-inf"):
            return None
        base, _, exp = text.partition("**")
        value = float(base) ** int(exp) if exp else float(text)
        return int(value) if value.is_integer() else value

    return Range(bound(m.group(2)), bound(m.group(3)), m.group(1) == "[", m.group(4) == "]", also, below)


# Named ranges, for the tables and declarations.
PROBABILITY = "[0, 1]"
POSITIVE = "(0, inf)"
ANY = "(-inf, inf)"
SIZE = "[1, 2**31)"  # larger model sizes and counts are not real configurations (and overflow int32 kernels)
COUNT = "[0, 2**31)"
SEED = "[0, 2**32)"
STEPS = "[0, 2**63)"  # iterations, samples, steps
INTERVAL = "[1, 2**63)"  # every N iterations
# Upper bounds where a larger value is never a real setting and breaks the run (a NaN loss at
# the first steps, a timer or sleep that overflows):
LEARNING_RATE = "[0, 10]"
WEIGHT_DECAY = "[0, 10]"
WEIGHT_STD = "(0, 10]"  # standard deviation of initial weights
LOSS_WEIGHT = "[0, 100]"  # coefficient of an auxiliary loss
FACTOR = "(0, 1000]"  # a scaling factor
SECONDS = "(0, 31536000]"  # durations in seconds: at most a year


def field(
    default: Any = dataclasses.MISSING,
    *,
    range: Any = None,  # noqa: A002 - reads as what it is at the declaration
    status: Optional[Unsupported] = None,
    **kwargs: Any,
) -> Any:
    """`dataclasses.field` that also records the field's `range` (a `Range`, or its text such as
    `"[0, 1]"`) and `status` (an `Unsupported`) for `config.schema`."""
    metadata = dict(kwargs.pop("metadata", None) or {})
    if range is not None:
        metadata[RANGE] = range if isinstance(range, Range) else parse(range)
    if status is not None:
        metadata[STATUS] = status
    return dataclasses.field(default=default, metadata=metadata, **kwargs)
