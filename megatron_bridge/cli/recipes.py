"""`mbridge recipes`: the recipe library, one line per recipe."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "recipes",
        help="list the recipes",
        description="List every recipe with its intended world size and what it trains. Use a name with "
        "`mbridge pretrain --recipe NAME` (the _config suffix may be left out). Your own recipes are given as "
        "--recipe my_pkg.recipes:my_config or --recipe path/to/file.py:my_config.",
    )
    p.set_defaults(handler=run)


def rows() -> list[tuple[str, int, str]]:
    """(name, intended world size, first docstring line) of every recipe, sorted by name; read
    from the recipes' source, without importing them (and megatron-core with them)."""
    from megatron_bridge.cli.recipe_loader import library_rows

    return library_rows()


def run(args: argparse.Namespace) -> int:
    table = rows()
    width = max(len(name) for name, _, _ in table)
    print(f"{'RECIPE':<{width}}  {'WORLD':>5}  DESCRIPTION")
    for name, world, doc in table:
        print(f"{name:<{width}}  {world:>5}  {doc}")
    return 0
