"""`mbridge hf import|export`: Hugging Face model directories to our checkpoints and back."""

from __future__ import annotations

import argparse
import os
from typing import Any

from megatron_bridge.cli.errors import UsageError
from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.runtime.checkpointing.safe_reading import UnsafeCheckpointError
from megatron_bridge.runtime.launcher_env import launcher_int

EPILOG = """\
examples:
  mbridge hf import /models/Meta-Llama-3-8B /ckpt/llama3-8b       a weights-only checkpoint of ours
  mbridge hf export runs/sft/checkpoints /models/llama3-8b-sft --dtype bf16
  torchrun --nproc_per_node=2 -m megatron_bridge hf import /models/Meta-Llama-3-8B /ckpt/llama3-8b --tp 2

Both run as one process or under torchrun (the model is split over the processes: --tp/--pp/--ep,
by default tensor parallel over all of them); each process reads or writes only its part."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "hf",
        help="convert Hugging Face model directories to our checkpoints and back",
        description="Convert between Hugging Face model directories (config.json, safetensors, tokenizer) and "
        "megatron_bridge checkpoints. Needs the 'hf' extra (safetensors), not transformers.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="hf_command", metavar="ACTION", required=True)
    imp = sub.add_parser(
        "import",
        help="a Hugging Face directory -> a weights-only checkpoint (load it with checkpoint.pretrained_checkpoint)",
        description="Write the weights of a Hugging Face model directory as a megatron_bridge checkpoint "
        "(OUT_DIR/iter_0000000 and its tracker), with its config.json and tokenizer alongside. Fine-tune from "
        "it with checkpoint.pretrained_checkpoint=OUT_DIR.",
    )
    imp.add_argument("hf_dir", metavar="HF_DIR", help="directory with config.json and *.safetensors")
    imp.add_argument("out_dir", metavar="OUT_DIR", help="checkpoint directory to create")
    imp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="weights dtype (default: config.json's)")
    _layout(imp)
    imp.set_defaults(handler=run_import)
    exp = sub.add_parser(
        "export",
        help="a checkpoint of ours -> a Hugging Face directory (safetensors, config.json, tokenizer)",
        description="Write the model weights of a megatron_bridge checkpoint as a Hugging Face model directory: "
        "sharded safetensors with an index, config.json and the tokenizer files. The adapters of a LoRA/DoRA "
        "checkpoint are folded into its base weights (W + alpha/dim B A; DoRA rescaled per row).",
    )
    exp.add_argument("ckpt", metavar="CKPT", help="a checkpoint save directory, or one of its iter_* directories")
    exp.add_argument("out_dir", metavar="OUT_DIR", help="Hugging Face directory to create (replaced if it exists)")
    exp.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        help="weights dtype (default: the Hugging Face model the checkpoint came from, else its training dtype)",
    )
    exp.add_argument("--step", type=int, metavar="N", help="export iteration N instead of the latest")
    exp.add_argument(
        "--base",
        metavar="DIR",
        help="for a LoRA/DoRA checkpoint: its base weights, a checkpoint or Hugging Face directory (default: the "
        "one the adapters record)",
    )
    exp.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="largest file, e.g. 5GB, 500MB (default: %(default)s)")
    _layout(exp)
    exp.set_defaults(handler=run_export)


def _layout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: all processes / (pp x ep))")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size, for mixture-of-experts models (default: 1)")
    p.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="process-group backend: nccl runs on the GPUs (one process per GPU), gloo on the CPU; auto: nccl "
        "where GPUs are visible, else gloo (default: %(default)s)",
    )


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    upper = text.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * units[unit])
    if upper.isdigit():
        return int(upper)
    raise UsageError(f"--max-shard-size {text!r}: expected a size such as 5GB or 500MB")


def _sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    world = launcher_int("WORLD_SIZE", 1)
    pp, ep = args.pp, args.ep
    tp = args.tp if args.tp is not None else max(1, world // (pp * ep))
    if min(tp, pp, ep) < 1 or world % (tp * pp) or (world // (tp * pp)) % ep:
        raise UsageError(f"--tp {tp} --pp {pp} --ep {ep} do not lay out over {world} process(es)")
    return tp, pp, ep


def _config_errors(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ConfigValidationError as exc:
        raise UsageError(str(exc)) from exc
    except (FileNotFoundError, UnsafeCheckpointError) as exc:
        raise UsageError(str(exc)) from exc


def run_import(args: argparse.Namespace) -> int:
    from megatron_bridge.models.hf.convert import import_hf
    from megatron_bridge.models.hf.files import is_hf_directory

    if not is_hf_directory(args.hf_dir):
        raise UsageError(f"{args.hf_dir!r} is not a Hugging Face model directory (config.json and model.safetensors[.index.json])")
    tp, pp, ep = _sizes(args)
    directory = _config_errors(import_hf, args.hf_dir, args.out_dir, tp=tp, pp=pp, ep=ep, dtype=args.dtype, backend=args.backend)
    if _last_rank():
        print(f"imported {args.hf_dir} -> {directory} (fine-tune with checkpoint.pretrained_checkpoint={args.out_dir})")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from megatron_bridge.models.hf.convert import export_checkpoint

    tp, pp, ep = _sizes(args)
    stats = _config_errors(
        export_checkpoint, args.ckpt, args.out_dir, dtype=args.dtype, step=args.step, tp=tp, pp=pp, ep=ep,
        max_shard_bytes=parse_size(args.max_shard_size), base=args.base, backend=args.backend,
    )  # fmt: skip
    if _last_rank():
        print(f"exported {args.ckpt} -> {args.out_dir} ({stats['tensors']} tensors in {stats['files']} files)")
    return 0


def _last_rank() -> bool:
    return launcher_int("RANK", 0) == launcher_int("WORLD_SIZE", 1) - 1
