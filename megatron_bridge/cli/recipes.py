"""`mbridge recipes`: the recipe library, one line per recipe."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "recipes",
        help="list the recipes",
        description="List every recipe with its intended world size and what it trains. Use a name with "
        "`mbridge pretrain --recipe NAME` (the _config suffix may be left out).",
    )
    p.set_defaults(handler=run)


def rows() -> list[tuple[str, int, str]]:
    """(name, intended world size, first docstring line) of every recipe, sorted by name."""
    import inspect

    import recipes

    out = []
    for name in recipes.list_recipes():
        fn = recipes.get_recipe(name)
        doc = inspect.getdoc(fn) or ""
        out.append((name, fn.world_size, doc.splitlines()[0] if doc else ""))
    return out


def run(args: argparse.Namespace) -> int:
    table = rows()
    width = max(len(name) for name, _, _ in table)
    print(f"{'RECIPE':<{width}}  {'WORLD':>5}  DESCRIPTION")
    for name, world, doc in table:
        print(f"{name:<{width}}  {world:>5}  {doc}")
    return 0
