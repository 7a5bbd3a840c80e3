"""`mbridge pretrain|finetune`: build the config from a recipe, a YAML file and overrides, then
show its help, dry-run or plan it, or train. The command's parser is `cli.training`; the
training entry points (torch, megatron-core) load only to train."""

from __future__ import annotations

import argparse
import os
from typing import Any

from megatron_bridge.cli import source
from megatron_bridge.cli.dry_run import PlanOptions, default_world_size, noted_decisions, print_dry_run, print_plan
from megatron_bridge.cli.errors import UsageError
from megatron_bridge.cli.help_config import help_text
from megatron_bridge.cli.recipe_loader import world_size_of
from megatron_bridge.cli.training import GPU_CHOICES
from megatron_bridge.config.errors import ConfigValidationError, RunStartError
from megatron_bridge.config.secrets import scrub
from megatron_bridge.training.console import log_to_console


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
    if not checking and args.help_config is None:
        log_to_console(None, is_logging_rank())  # what building the recipe decides is shown too
    shortcuts = {k: v for k, v in (("dir", args.dir), ("name", args.name)) if v is not None}
    with noted_decisions() as building:  # shown by a dry run
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
            print_dry_run(cfg, world, why, _label(args, fn), options, finetuning=cmd == "finetune", notes=building)
        return 0
    train(cfg, cmd)
    return 0


def train(cfg: Any, cmd: str) -> None:
    """Run the `cmd` entry point with the standard GPT forward step; on the logging rank, say
    where the outputs are."""
    from megatron_bridge.training.gpt_step import forward_step  # torch and megatron-core: only to train

    if cmd == "finetune":
        from megatron_bridge.training.finetune import finetune as entry
    else:
        from megatron_bridge.training.pretrain import pretrain as entry
    try:
        entry(cfg, forward_step)
    except (ConfigValidationError, RunStartError) as exc:  # found resolving the config here, or starting the run
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

