"""The rule engine: how a config is resolved, step by step, in one fixed order.

A rule is a preset, the device adaptation, a deprecated alias, a sync between sections, a derived
value, a section's finalize, or a check. The list of rules is declared once
(`megatron_bridge.training.config.runtime.RULES`) and printed by `mbridge config rules`; this module
runs it and owns the policies every rule follows:

* **Set unless the user did** (`set_unless_user_set`): a field the user set is never changed (a
  different value is a clash, which the rule reports or, where the rule says so, ignores); any
  other field takes the rule's value as a framework default (`ConfigBase.apply_default`: not the
  user's, kept by `finalize()`, written to YAML as such); each change is returned for the log.
* **Derived values are remembered** (`ConfigBase._derive`) and put back before the next run, so
  running the rules again recomputes them from the current fields.
* **Checks change nothing**: they run with the config and its sections read-only (`run_rules`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Sequence

from megatron_bridge.config.annotations import values_equal
from megatron_bridge.config.base import set_read_only
from megatron_bridge.config.errors import Problems

logger = logging.getLogger(__name__)

Clash = Callable[[str, Any, Any], Optional[tuple[str, str]]]
"""(field, user's value, rule's value) -> (message, fix) of the problem to report, or None."""


def set_unless_user_set(
    target: Any,
    values: Mapping[str, Any],
    problems: Problems,
    where: str,
    clash: Clash,
    show: Callable[[Any], str] = repr,
) -> list[str]:
    """Give each field of `target` named in `values` its value, unless the user set the field;
    report a user's different value through `clash` at `where.<field>`. Returns the changes as
    `where.field=value` texts (`show` formats the values)."""
    changed = []
    is_explicit = getattr(target, "is_explicit", None)
    for name, value in values.items():
        current = getattr(target, name)
        if is_explicit is not None and is_explicit(name):
            report = None if values_equal(current, value) else clash(name, current, value)
            if report is not None:
                problems.add(f"{where}.{name}", *report)
            continue
        if not values_equal(current, value):
            changed.append(f"{where}.{name}={show(value)}")
        if is_explicit is not None:
            target.apply_default(name, value)
        else:  # a megatron-core config without the user-set record: everything is the framework's
            setattr(target, name, value)
    return changed


# ---------------------------------------------------------------------- the engine
KINDS = {
    "setup": "prepares the run's environment",
    "adapt": "adapts the config to the device it trains on",
    "preset": "sets fields from a preset, unless the user set them",
    "alias": "moves a deprecated field's value to its new place",
    "sync": "keeps one setting that lives in two sections in agreement",
    "derive": "computes fields from other fields",
    "finalize": "runs each section's own checks and derived values",
    "check": "reports problems; changes nothing",
}
"""What each kind of rule may do."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """One step of resolving a config: `run(cfg, problems, *inputs)` at a fixed place in the list."""

    name: str
    kind: str
    """One of `KINDS`."""
    run: Callable[..., None]
    validate: bool = True
    """Part of `validate()`; False for the steps only `runtime_config_update` takes (presets,
    environment, device)."""
    inputs: tuple[str, ...] = ()
    """Run inputs passed after `problems`, by name (e.g. "world_size"); None when not given."""
    device: Optional[str] = None
    """Taken only when the run trains on this device."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"rule {self.name!r}: unknown kind {self.kind!r} (one of {', '.join(KINDS)})")


def run_rules(rules: Sequence[Rule], cfg: Any, problems: Problems, inputs: Mapping[str, Any]) -> None:
    """Run `rules` in order on `cfg`, collecting problems; each rule taken is logged (DEBUG).

    A `check` runs with `cfg` and its sections read-only, so a check that changes a field fails
    loudly instead of deriving a value in the wrong place. A rule that trips over a value an
    earlier rule already reported (a division by zero from a bad size) stays quiet; the same
    error with no problem reported is a bug and propagates."""
    read_only = False  # consecutive checks share one read-only span
    log = logger.isEnabledFor(logging.DEBUG)  # asked once: this runs on every config update
    try:
        for rule in rules:
            if rule.device is not None and inputs.get("device") != rule.device:
                continue
            if log:
                logger.debug("rule: %s", rule.name)
            if (rule.kind == "check") != read_only:
                read_only = rule.kind == "check"
                set_read_only(cfg, read_only)
            try:
                if rule.inputs:
                    rule.run(cfg, problems, *[inputs.get(name) for name in rule.inputs])
                else:
                    rule.run(cfg, problems)
            except (ArithmeticError, ValueError, TypeError):
                if not problems:
                    raise
    finally:
        if read_only:
            set_read_only(cfg, False)


def describe(rules: Sequence[Rule]) -> str:
    """The rules as a numbered list in the order they run, each with its kind and what it does."""
    lines = []
    for i, rule in enumerate(rules, 1):
        notes = [] if rule.validate else ["runtime_config_update only"]
        if rule.device:
            notes.append(f"only on {rule.device}")
        suffix = f"  [{'; '.join(notes)}]" if notes else ""
        lines.append(f"{i:2d}. {rule.kind:8s} {rule.name}{suffix}")
        doc = " ".join((rule.run.__doc__ or "").split())
        if doc:  # its first sentence
            lines.append(f"    {'':8s} {doc[: doc.find('. ') + 1] or doc}")
    return "\n".join(lines)
