"""How a rule (a preset, the CPU adaptation, a cross-section sync) sets fields of a section.

Every rule follows one policy, owned here: a field the user set is never changed (a different
value is a clash, which the rule reports or, where the rule says so, ignores); any other field
takes the rule's value as a framework default (`ConfigBase.apply_default`: not the user's, kept by
`finalize()`, written to YAML as such); each change is returned so the rule can log it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from megatron_bridge.config.annotations import values_equal
from megatron_bridge.config.errors import Problems

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
