"""`mbridge`: dispatch to the subcommand modules listed in `SUBCOMMANDS`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from types import ModuleType
from typing import Optional, Sequence

from megatron_bridge.cli.common import add_debug_flag
from megatron_bridge.cli.errors import EXIT_USAGE, UsageError
from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge import __version__
from megatron_bridge.warning_filters import quiet_known_warnings

SUBCOMMANDS = ("recipes", "pretrain", "finetune", "config", "plot", "peft", "slurm", "hf", "data", "generate", "evaluate")
"""Modules of `megatron_bridge.cli` that each add one subcommand (`register(subparsers)`).
A module that does not exist (yet) is skipped."""

DESCRIPTION = """\
Train megatron-core models from typed, validated configs.

  mbridge recipes                                   list the recipes
  mbridge pretrain --recipe NAME [KEY=VALUE ...]    train (also under torchrun)
  mbridge pretrain --recipe NAME --dry-run          print the resolved config, derived sizes and the plan
  mbridge pretrain --recipe NAME --plan-only        memory per GPU, fit, fixes, step time (--gpu, --mfu, --json)
  mbridge slurm --recipe NAME --nodes N --gpus-per-node G   write an sbatch script (requeues on preemption)
  mbridge config show|diff ...                      print or compare configs
  mbridge peft merge|export CKPT OUT                fold LoRA/DoRA adapters in, or write them for `peft`
  mbridge hf import|export ...                      Hugging Face model directories in and out
  mbridge data preprocess|inspect ...               text to indexed datasets (.bin/.idx), and a look at one
  mbridge generate SOURCE --prompt TEXT             text from a Hugging Face model or a checkpoint
  mbridge eval SOURCE --data FILE                   loss, perplexity, multiple-choice accuracy on a data file

`mbridge COMMAND --help` describes each command."""


def _subcommand_module(name: str) -> Optional[ModuleType]:
    qualified = f"{__package__}.{name}"
    try:
        return importlib.import_module(qualified)
    except ModuleNotFoundError as exc:
        if exc.name == qualified:  # not written yet: the CLI works without it
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    """The `mbridge` parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="mbridge", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="on a config or command-line error, also print the Python traceback"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = _subcommand_module(name)
        if module is not None:
            module.register(subparsers)
    for sub in subparsers.choices.values():
        try:
            add_debug_flag(sub)
        except argparse.ArgumentError:  # the module declared its own (or an alias: same parser)
            pass
    return parser


def _quiet_third_party_warnings() -> None:
    quiet_known_warnings()


def _parse(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    # argparse stops collecting a positional list at the first option, so `KEY=VALUE` overrides
    # after an option come back as extras; they belong to the overrides.
    args, extras = parser.parse_known_args(argv)
    if extras:
        if hasattr(args, "overrides") and not any(e.startswith("-") for e in extras):
            args.overrides = [*args.overrides, *extras]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `mbridge` with `argv` (default: sys.argv[1:]); return the exit status.

    A bad command line or config (a `UsageError` or `ConfigValidationError`) prints one report to
    stderr and returns 2 (`--debug` adds the traceback); any other exception propagates with its
    traceback.
    """
    _quiet_third_party_warnings()
    parser = build_parser()
    try:
        args = _parse(parser, argv)
    except SystemExit as exc:  # --help / --version (0) or an argparse usage error (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    try:
        return args.handler(args) or 0
    except (UsageError, ConfigValidationError) as exc:  # the latter: a problem no command wrapped (a launcher variable)
        if args.debug:
            traceback.print_exception(exc)
        print(f"mbridge {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(
            f"mbridge {args.command}: interrupted. Runs with train.exit_signal_handler=true (the recipes' "
            "default) save a checkpoint on the first Ctrl-C and exit; a second one aborts.",
            file=sys.stderr,
        )
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
