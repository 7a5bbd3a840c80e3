"""What `mbridge pretrain` and `mbridge finetune` share: their options, and running them."""

from __future__ import annotations

import argparse
import os
import textwrap
from typing import Any

from megatron_bridge.cli.errors import UsageError
from megatron_bridge.cli import source
from megatron_bridge.cli.dry_run import PlanOptions, default_world_size, print_dry_run, print_plan
from megatron_bridge.cli.help_config import help_text
from megatron_bridge.cli.recipe_loader import world_size_of
from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.config.secrets import scrub

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


def _label(args: argparse.Namespace, fn: Any) -> str:
    if fn is not None:
        return fn.__name__ + (f" + {args.config_file}" if args.config_file else "")
    return str(args.config_file)


def run(args: argparse.Namespace, cmd: str) -> int:
    """`mbridge pretrain|finetune`: build the config, then show help, dry-run, or train."""
    checking = args.dry_run or args.plan_only
    if args.world_size is not None and not checking:
        raise UsageError(
            "--world-size only applies to --dry-run and --plan-only (a real run uses the processes launched)"
        )
    shaping = (("--gpu", args.gpu is not None), ("--mfu", args.mfu is not None), ("--no-te", not args.target_te))
    for flag, given in shaping:
        if given and not checking:
            raise UsageError(f"{flag} only applies to --dry-run and --plan-only (it shapes the plan, not the run)")
    if args.json and not args.plan_only:
        raise UsageError("--json only applies to --plan-only (the dry run prints YAML)")
    shortcuts = {k: v for k, v in (("dir", args.dir), ("name", args.name)) if v is not None}
    cfg = source.build_config(args.recipe, args.recipe_args, shortcuts, args.config_file, args.overrides)
    fn = source.get_recipe(args.recipe) if args.recipe is not None else None
    if args.help_config is not None:
        options = source.recipe_options(fn, args.recipe_args, shortcuts) if fn is not None else None
        print(help_text(cfg, args.help_config, options, _label(args, fn)))
        return 0
    if checking:
        if args.world_size is not None:
            world, why = args.world_size, "--world-size"
        else:
            world, why = default_world_size(world_size_of(fn, cfg))
        options = PlanOptions(gpu=args.gpu or GPU_CHOICES[0], mfu=args.mfu, as_json=args.json, target_te=args.target_te)
        if args.plan_only:
            print_plan(cfg, world, why, _label(args, fn), options, finetuning=cmd == "finetune")
        else:
            print_dry_run(cfg, world, why, _label(args, fn), options, finetuning=cmd == "finetune")
        return 0
    train(cfg, cmd)
    return 0


def train(cfg: Any, cmd: str) -> None:
    """Run the `cmd` entry point with the standard GPT forward step; on the logging rank, say
    where the outputs are."""
    from megatron_bridge.training.gpt_step import forward_step

    if cmd == "finetune":
        from megatron_bridge.training.finetune import finetune as entry
    else:
        from megatron_bridge.training.pretrain import pretrain as entry
    try:
        entry(cfg, forward_step)
    except ConfigValidationError as exc:  # found while resolving the config for this machine
        raise UsageError(str(exc)) from exc
    if is_logging_rank():
        print(outputs_line(cfg), flush=True)


def is_logging_rank() -> bool:
    """The last rank logs (as the trainer does); a plain process is rank 0 of 1."""
    rank = os.environ.get("RANK", "0")
    world = os.environ.get("WORLD_SIZE", "1")
    return not (rank.isdigit() and world.isdigit()) or int(rank) == int(world) - 1


def outputs_line(cfg: Any) -> str:
    """`checkpoints: DIR | tensorboard: DIR` of a finished run."""
    ckpt = scrub(cfg.checkpoint.save) if cfg.checkpoint.save else "not saved (checkpoint.save is unset)"
    tb = scrub(cfg.logger.tensorboard_dir) if cfg.logger.tensorboard_dir else "off (logger.tensorboard_dir is unset)"
    return f"checkpoints: {ckpt} | tensorboard: {tb}"

