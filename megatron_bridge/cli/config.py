"""`mbridge config show|diff|rules`: print a config as YAML, the fields where two configs differ,
or the rules that resolve a config, in the order they run.

A config is named by a YAML file (an existing path, or any name ending in .yaml/.yml) or a recipe.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterator

from megatron_bridge.cli.common import add_debug_flag

BOOKKEEPING = frozenset({"_explicit_", "_implicit_", "_derived_"})
"""Keys of `to_dict()` that record who set a field, not what the config is."""

_ABSENT = object()


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "config",
        help="print a config as YAML, or compare two",
        description="Print or compare configs. SOURCE is a YAML file or a recipe name.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="print a config as YAML",
        description="Print the config of a YAML file or recipe (with overrides applied) as YAML. "
        "Not resolved: `mbridge pretrain --dry-run` shows the derived values too.",
    )
    show.add_argument("source", metavar="SOURCE", help="YAML file or recipe name")
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides applied before printing")
    show.set_defaults(handler=run_show, command="config show")
    diff = actions.add_parser(
        "diff",
        help="print the fields where two configs differ",
        description="Print each field whose value differs between A and B, one per line as "
        "`dotted.path: A_value -> B_value` (`<absent>` where a side has no such field). Fields that "
        "validation derives from others (scheduler steps, data-parallel size, ...) are hidden unless --derived.",
    )
    diff.add_argument("a", metavar="A", help="YAML file or recipe name")
    diff.add_argument("b", metavar="B", help="YAML file or recipe name")
    diff.add_argument("--derived", action="store_true", help="also show fields derived from other fields")
    diff.set_defaults(handler=run_diff, command="config diff")
    rules = actions.add_parser(
        "rules",
        help="print the rules that resolve a config, in the order they run",
        description="Print every rule runtime_config_update takes (presets, device adaptation, aliases, "
        "derived values, checks), numbered in the order it runs, with what it does.",
    )
    rules.set_defaults(handler=run_rules, command="config rules")
    for sub in (show, diff, rules):
        add_debug_flag(sub)


def run_show(args: argparse.Namespace) -> int:
    from megatron_bridge.cli.source import load_source

    print(load_source(args.source, args.overrides).to_yaml(), end="")
    return 0


def run_rules(args: argparse.Namespace) -> int:
    from megatron_bridge.config.rules import KINDS, describe
    from megatron_bridge.training.config.runtime import RULES

    print(describe(RULES))
    print("\nKinds: " + "; ".join(f"{kind}: {what}" for kind, what in KINDS.items()) + ".")
    return 0


def run_diff(args: argparse.Namespace) -> int:
    from megatron_bridge.cli.source import load_source

    a = load_source(args.a).to_dict()
    b = load_source(args.b).to_dict()
    changes = list(differences(a, b))
    hidden = 0
    if not args.derived:
        derived = derived_paths(a) | derived_paths(b)
        shown = [c for c in changes if c[0] not in derived and not _resolved_preset(*c)]
        hidden, changes = len(changes) - len(shown), shown
    for path, old, new in changes:
        print(f"{path}: {render(old)} -> {render(new)}")
    if not changes:
        print("no differences" + (" but derived ones" if hidden else ""), file=sys.stderr)
    if hidden:
        print(f"({hidden} derived field{'s' * (hidden != 1)} hidden; --derived shows them)", file=sys.stderr)
    return 0


def derived_paths(tree: Any, path: str = "") -> set[str]:
    """Dotted paths of the fields no user set: derived from other fields (`_derived_`) or filled
    in by the framework (`_implicit_`: preset values, a recipe's defaults, sizes)."""
    found: set[str] = set()
    if isinstance(tree, dict):
        for name in [*(tree.get("_derived_") or ()), *(tree.get("_implicit_") or ())]:
            found.add(f"{path}.{name}" if path else str(name))
        for key, value in tree.items():
            if key not in BOOKKEEPING:
                found |= derived_paths(value, f"{path}.{key}" if path else str(key))
    return found


def _resolved_preset(path: str, a: Any, b: Any) -> bool:
    """A preset name on one side, the config validation resolved it to on the other."""
    return path == "mixed_precision" and {type(a), type(b)} == {str, dict}


def differences(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted path, a value, b value) for each leaf where `to_dict()` outputs `a` and `b` differ;
    a section present on one side only is one entry."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if key in BOOKKEEPING:
                continue
            sub = f"{path}.{key}" if path else str(key)
            yield from differences(a.get(key, _ABSENT), b.get(key, _ABSENT), sub)
    elif not _same(a, b):
        yield path, a, b


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):  # True == 1 in Python, not in a config
        return type(a) is type(b) and a == b
    return _plain(a) == _plain(b)


def _plain(value: Any) -> Any:
    """Lists/dicts as the built-in types (to_dict may use list subclasses for flow style)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def render(value: Any) -> str:
    """A value as a YAML flow scalar/collection; a whole section by its class."""
    import yaml

    if value is _ABSENT:
        return "<absent>"
    if isinstance(value, dict) and "_target_" in value:
        return f"{{_target_: {value['_target_']}, ...}}"
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=1 << 30).strip()
    return text[: -len("...")].strip() if text.endswith("\n...") else text
