"""What `mbridge pretrain` and `mbridge finetune` share: their options; `training_run` runs them."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any


EPILOG = """\
precedence (later wins): the recipe called with its options < --config-file < KEY=VALUE overrides

recipe options are the keyword arguments of the recipe function (dir, name, train_iters,
global_batch_size, seq_length, tensor_model_parallel_size, ...; `--help-config options` lists
them with the recipe's defaults). They shape the whole recipe, e.g. name sets the checkpoint and
TensorBoard directories (DIR/NAME/checkpoints, DIR/NAME/tb_logs).

examples:
  mbridge {cmd} --recipe {tiny}{tiny_args} train.train_iters=20 optimizer.lr=1e-3
  mbridge {cmd} --recipe {tiny}{tiny_args} --dir /results --name try1 --recipe-arg global_batch_size=16
  mbridge {cmd} --recipe {gpu}{gpu_args} --dry-run --world-size 16
  mbridge {cmd} --config-file run.yaml train.train_iters=100
  mbridge {cmd} --recipe {gpu} --help-config train
  torchrun --nproc_per_node=8 -m megatron_bridge {cmd} --recipe {gpu} --dir /results
"""


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


GPU_CHOICES = ("h100-80gb", "h200-141gb", "a100-80gb", "b200-180gb")
"""`--gpu` values (the keys of megatron_bridge.planning.devices.GPUS; not imported here: --help stays fast)."""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def add_parser(subparsers: Any, cmd: str, summary: str, description: str, tiny: str, gpu: str,
               tiny_args: str = "", gpu_args: str = "") -> argparse.ArgumentParser:
    """The parser of training subcommand `cmd` (its handler runs the `cmd` entry point); `tiny`
    and `gpu` are the recipes its examples use, `tiny_args`/`gpu_args` the options they need."""
    p = subparsers.add_parser(
        cmd,
        help=summary,
        description=textwrap.fill(description, 100),
        epilog=EPILOG.format(cmd=cmd, tiny=tiny, gpu=gpu, tiny_args=tiny_args, gpu_args=gpu_args),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("config")
    src.add_argument(
        "--recipe",
        metavar="NAME",
        help="recipe to start from: a library name (`mbridge recipes` lists them), module.path:function "
        "or path/to/file.py:function",
    )
    src.add_argument(
        "--config-file",
        metavar="FILE",
        help="YAML merged over the recipe; without --recipe, a complete config (as written by to_yaml)",
    )
    src.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, Hydra syntax: train.train_iters=100, dataset.data_path=[a,b], ++env_vars.X=1, ~key",
    )
    opts = p.add_argument_group("recipe options (keyword arguments of the recipe function)")
    opts.add_argument(
        "--recipe-arg",
        dest="recipe_args",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one recipe option, e.g. --recipe-arg seq_length=4096 (repeatable; typed like overrides)",
    )
    opts.add_argument("--dir", help="shortcut for --recipe-arg dir=DIR: base output directory")
    opts.add_argument("--name", help="shortcut for --recipe-arg name=NAME: run name; outputs go to DIR/NAME")
    check = p.add_argument_group("checking without training")
    check.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve the config as a run on the GPUs would (no process group, no CPU adaptation, TransformerEngine "
        "taken as installed there unless --no-te), print it and the derived sizes (data-parallel size, "
        "microbatches, scheduler steps, parameters, tokens/step), exit",
    )
    check.add_argument(
        "--world-size",
        type=_positive_int,
        metavar="N",
        help="world size for --dry-run (default: WORLD_SIZE, else the recipe's intended world size, else 1)",
    )
    check.add_argument(
        "--plan-only",
        action="store_true",
        help="print only the plan: memory per GPU (parameters, gradients, optimizer, activations, workspace), "
        "fit and margin, ranked fixes when it does not fit, step time and tokens/s at --mfu, pipeline bubble "
        "(--dry-run prints it after the config)",
    )
    check.add_argument(
        "--gpu",
        choices=GPU_CHOICES,
        default=None,
        help=f"GPU to plan for (default: {GPU_CHOICES[0]})",
    )
    check.add_argument(
        "--mfu",
        type=_fraction,
        default=None,
        metavar="F",
        help="model FLOPs utilization assumed for step time and tokens/s (default: 0.40)",
    )
    check.add_argument(
        "--json", action="store_true", help="with --plan-only: print the plan as JSON, one record per rank layout"
    )
    check.add_argument(
        "--no-te",
        dest="target_te",
        action="store_false",
        help="resolve and plan for GPUs without TransformerEngine (megatron-core's local layers); by default "
        "TransformerEngine is taken as installed on the GPUs, whatever this machine has",
    )
    check.add_argument(
        "--help-config",
        nargs="?",
        const="",
        metavar="SECTION",
        help="list the config sections, or the fields of SECTION (e.g. train, model, optimizer, options) "
        "with types, the config's values, class defaults and docs; SECTION.FIELD shows one field",
    )
    p.set_defaults(handler=lambda args: run(args, cmd))
    return p


def run(args: argparse.Namespace, cmd: str) -> int:
    """`mbridge pretrain|finetune` (`training_run.run`): loaded only when the command runs, so
    `--help` stays light."""
    from megatron_bridge.cli import training_run

    return training_run.run(args, cmd)
