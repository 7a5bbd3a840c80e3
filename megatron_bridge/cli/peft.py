"""`mbridge peft merge|export`: fold a PEFT run's adapters into its base, or write them in the
format of the `peft` library."""

from __future__ import annotations

import argparse
from typing import Any

from megatron_bridge.cli.common import add_debug_flag
from megatron_bridge.cli.errors import UsageError, config_errors_are_usage_errors


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "peft",
        help="merge or export the adapters of a LoRA/DoRA run",
        description="Work with the checkpoints of a LoRA/DoRA run (which hold only the adapters and "
        "record the base checkpoint they were trained on).",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    merge = actions.add_parser(
        "merge",
        help="write a full checkpoint with the adapters folded into the base weights",
        description="Load the base weights and the adapters of CKPT (a save directory or one iter_* "
        "directory), fold the adapters into the weights, and save a complete checkpoint under OUT "
        "(OUT/iter_N, N the adapters' iteration). Runs in one process on the CPU; the result loads "
        "in any parallel layout, e.g. as checkpoint.pretrained_checkpoint.",
    )
    merge.add_argument("checkpoint", metavar="CKPT", help="checkpoint of a LoRA/DoRA run")
    merge.add_argument("out", metavar="OUT", help="directory to save the merged checkpoint in")
    merge.add_argument("--base", metavar="DIR", help="base checkpoint (default: the one the adapters record)")
    merge.set_defaults(handler=run_merge, command="peft merge")
    export = actions.add_parser(
        "export",
        help="write the adapters as adapter_config.json + adapter_model.safetensors (peft format)",
        description="Write the adapters of CKPT to OUT_DIR in the format of the `peft` library, with "
        "Hugging Face module names (linear_qkv -> q_proj/k_proj/v_proj, linear_proj -> o_proj, "
        "linear_fc1 -> gate_proj/up_proj, linear_fc2 -> down_proj), for Llama-style models.",
    )
    export.add_argument("checkpoint", metavar="CKPT", help="checkpoint of a LoRA/DoRA run")
    export.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the adapter files to")
    export.add_argument(
        "--base-model",
        metavar="NAME",
        help="base_model_name_or_path to record (default: the Hugging Face directory of the base weights, which "
        "AutoPeftModelForCausalLM loads; else the base checkpoint's path)",
    )
    export.set_defaults(handler=run_export, command="peft export")
    for sub in (merge, export):
        add_debug_flag(sub)


def _check_input(args: argparse.Namespace) -> None:
    """Bad input (no such checkpoint, not a PEFT run, base missing) is a usage error, reported
    before any work starts."""
    with config_errors_are_usage_errors():
        from megatron_bridge.peft.merge import base_of, read_adapter_checkpoint

        _, _, cfg, common = read_adapter_checkpoint(args.checkpoint)
        if args.action == "merge":
            base_of(cfg, common, args.base)


def run_merge(args: argparse.Namespace) -> int:
    _check_input(args)
    from megatron_bridge.peft.merge import merge_checkpoint

    final = merge_checkpoint(args.checkpoint, args.out, base=args.base)
    print(f"merged checkpoint: {final}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    _check_input(args)
    from megatron_bridge.peft.export import export_adapters
    from megatron_bridge.peft.hf_names import UnmappedModuleError

    try:
        files = export_adapters(args.checkpoint, args.out_dir, base_model=args.base_model)
    except UnmappedModuleError as exc:
        raise UsageError(str(exc)) from exc
    for path in files:
        print(path)
    return 0
