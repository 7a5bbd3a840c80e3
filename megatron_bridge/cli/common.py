"""Options every subcommand shares."""

from __future__ import annotations

import argparse


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """`--debug`: show the traceback of a config error too. SUPPRESS keeps a subcommand parser
    from resetting a `--debug` given before the subcommand name."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="on a config or command-line error, also print the Python traceback",
    )
