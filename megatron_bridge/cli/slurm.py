"""`mbridge slurm`: write an sbatch script that trains a recipe on N nodes and requeues itself."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Any

from megatron_bridge.cli.errors import UsageError, config_errors_are_usage_errors
from megatron_bridge.cli import source
from megatron_bridge.cli.dry_run import for_target, resolve
from megatron_bridge.config.errors import Problems

EPILOG = """\
The script runs `torchrun -m megatron_bridge pretrain|finetune ...` on every node (c10d rendezvous on
the first node of the allocation), sets the usual NCCL/CUDA environment, and stops with a checkpoint on
preemption (SIGTERM) or --signal-seconds before the time limit, then requeues the job, which resumes.

examples:
  mbridge slurm --recipe llama3_70b_pretrain_config --nodes 8 --gpus-per-node 8 --time 04:00:00 \\
      --container nvcr.io/nvidia/pytorch:25.01-py3 --container-mounts /lustre:/lustre --dir /lustre/runs
  sbatch llama3_70b_pretrain.sbatch
  mbridge slurm --recipe tiny_gpt_pretrain_config --nodes 2 --gpus-per-node 4 --cpu train.train_iters=100
"""


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "slurm",
        help="write an sbatch script for a multi-node run (requeued on preemption)",
        description=textwrap.fill(
            "Write an sbatch script that trains a recipe (or YAML config) with torchrun on every node of a Slurm "
            "job. The config is resolved at nodes x gpus-per-node ranks first, so a bad config fails here, not "
            "in the queue.",
            100,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("config (as for mbridge pretrain)")
    src.add_argument(
        "--recipe",
        metavar="NAME",
        help="recipe to train: a library name (`mbridge recipes` lists them), module.path:function or "
        "path/to/file.py:function",
    )
    src.add_argument("--config-file", metavar="FILE", help="YAML merged over the recipe, or a complete config")
    src.add_argument("--mode", choices=("pretrain", "finetune"), help="default: finetune for *_finetune_config recipes")
    src.add_argument(
        "--recipe-arg",
        dest="recipe_args",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one recipe option (repeatable)",
    )
    src.add_argument("--dir", help="base output directory (recipe option dir)")
    src.add_argument("--name", help="run name (recipe option name); also the default job name")
    src.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, as for mbridge pretrain")
    res = p.add_argument_group("resources")
    res.add_argument("--nodes", type=_positive_int, required=True, help="nodes to run on")
    res.add_argument(
        "--gpus-per-node",
        type=_positive_int,
        required=True,
        help="GPUs per node, one training process each (with --cpu: processes per node)",
    )
    res.add_argument(
        "--cpu", action="store_true", help="CPU nodes: request no GPUs; --gpus-per-node processes per node"
    )
    res.add_argument("--partition", help="#SBATCH --partition")
    res.add_argument("--account", help="#SBATCH --account")
    res.add_argument("--time", help="#SBATCH --time, e.g. 04:00:00")
    res.add_argument("--job-name", help="#SBATCH --job-name (default: the run name)")
    res.add_argument("--container", metavar="IMAGE", help="run in this container image (pyxis: srun --container-image)")
    res.add_argument("--container-mounts", metavar="SRC:DST[,...]", help="srun --container-mounts")
    res.add_argument(
        "--signal-seconds",
        type=_positive_int,
        default=120,
        help="warn the job this long before its time limit, to checkpoint and requeue (default: 120)",
    )
    res.add_argument("--python", help="Python inside the job (default: this interpreter; 'python' in a container)")
    res.add_argument(
        "--log-dir", default="slurm_logs", help="directory of the job's output files (default: slurm_logs)"
    )
    res.add_argument("--gpu", default="h100-80gb", help="GPU the plan in the script header is made for")
    res.add_argument(
        "--no-te",
        dest="target_te",
        action="store_false",
        help="check the config for GPU nodes without TransformerEngine (megatron-core's local layers); by default "
        "it is taken as installed there",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="script to write (default: JOB_NAME.sbatch; '-': stdout)")
    p.set_defaults(handler=run)


def _command(args: argparse.Namespace, mode: str, extra: list[str]) -> list[str]:
    cmd = [mode]
    if args.recipe:
        cmd += ["--recipe", args.recipe]
    if args.config_file:
        cmd += ["--config-file", os.path.abspath(args.config_file)]
    for assignment in args.recipe_args:
        cmd += ["--recipe-arg", assignment]
    for flag, value in (("--dir", args.dir), ("--name", args.name)):
        if value is not None:
            cmd += [flag, value]
    return cmd + list(args.overrides) + extra


def run(args: argparse.Namespace) -> int:
    import signal

    from megatron_bridge.launch.slurm import SlurmJob, render

    if args.container_mounts and not args.container:
        raise UsageError("--container-mounts needs --container IMAGE")
    mode = args.mode or ("finetune" if (args.recipe or "").endswith("_finetune_config") else "pretrain")
    shortcuts = {k: v for k, v in (("dir", args.dir), ("name", args.name)) if v is not None}
    cfg = source.build_config(args.recipe, args.recipe_args, shortcuts, args.config_file, args.overrides)
    t, ckpt = cfg.train, cfg.checkpoint
    problems = Problems()
    problems.check(
        not (t.is_explicit("exit_signal_handler") and not t.exit_signal_handler),
        "train.exit_signal_handler",
        "false, but a requeued job resumes from the checkpoint saved on the exit signal",
        "leave it unset: the script turns it on",
    )
    problems.check(
        bool(ckpt.save),
        "checkpoint.save",
        "is not set: a preempted job would start over when requeued",
        "set checkpoint.save=DIR",
    )
    backend = cfg.dist.distributed_backend
    problems.check(
        not (args.cpu and backend == "nccl"),
        "dist.distributed_backend",
        "'nccl' trains on GPUs, but --cpu asks for nodes without GPUs",
        "leave it unset with --cpu (the script sets gloo), or drop --cpu",
    )
    problems.check(
        args.cpu or backend != "gloo",
        "dist.distributed_backend",
        f"'gloo' trains on CPU, but the script asks for {args.gpus_per_node} GPUs per node",
        "add --cpu (no GPUs requested), or leave it unset to train on the GPUs",
    )
    extra = ["train.exit_signal_handler=true"]
    if args.cpu and backend == "auto":
        extra.append("dist.distributed_backend=gloo")  # CPU nodes that show a GPU must not pick NCCL
    if ckpt.save and not ckpt.load:
        extra.append(f"checkpoint.load={ckpt.save}")
    elif ckpt.save:
        problems.check(
            os.path.abspath(ckpt.load) == os.path.abspath(ckpt.save),
            "checkpoint.load",
            f"{ckpt.load!r} differs from checkpoint.save={ckpt.save!r}: a requeued job would not resume from its own "
            "checkpoints",
            "load from the save directory; start from other weights with checkpoint.pretrained_checkpoint",
        )
    with config_errors_are_usage_errors("the config cannot be requeued: "):
        problems.raise_if_any()
    world = args.nodes * args.gpus_per_node
    target_te = args.target_te and not args.cpu  # resolved for the nodes the job runs on, not for this machine
    resolve(cfg, world, target_te=target_te)
    job_name = args.job_name or args.name or (args.recipe or "mbridge").removesuffix("_config")
    notes = [
        "Written by: mbridge slurm " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["slurm"] else sys.argv[1:]),
        f"{args.nodes} nodes x {args.gpus_per_node} {'processes' if args.cpu else 'GPUs'} = {world} ranks",
    ]
    if not args.cpu:
        with for_target(target_te):
            notes += _plan_notes(cfg, args.gpu, job_name)
    job = SlurmJob(
        command=_command(args, mode, extra),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        job_name=job_name,
        partition=args.partition,
        account=args.account,
        time=args.time,
        container_image=args.container,
        container_mounts=args.container_mounts,
        log_dir=args.log_dir,
        signal_seconds=args.signal_seconds,
        exit_signal=signal.Signals(t.exit_signal).name.removeprefix("SIG"),
        python=args.python or ("python" if args.container else sys.executable),
        cpu=args.cpu,
        header_notes=notes,
    )
    text = render(job)
    if args.output == "-":
        print(text, end="")
        return 0
    path = args.output or f"{job_name}.sbatch"
    os.makedirs(args.log_dir, exist_ok=True)  # Slurm opens --output before the script runs
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    print(f"wrote {path}; submit it with: sbatch {path}")
    return 0


def _plan_notes(cfg: Any, gpu: str, label: str) -> list[str]:
    """The plan's verdict as comment lines (a warning on stderr when it does not fit)."""
    from megatron_bridge.planning import PlanningError, plan

    try:
        p = plan(cfg, gpu=gpu, label=label, with_fixes=False)
    except (PlanningError, ValueError) as exc:
        return [f"plan: not available ({exc})"]
    w = p.worst
    verdict = "fits" if p.fits else "DOES NOT FIT"
    line = (
        f"plan on {p.gpu.name}: {verdict}, {w.total / 2**30:.1f} of {p.gpu.memory_bytes / 2**30:.1f} GiB on the "
        f"fullest GPU; step ~{p.timing.step_time_s:.3g} s at MFU {p.mfu:.2f} (mbridge pretrain --plan-only for details)"
    )
    if not p.fits:
        print(f"mbridge slurm: warning: {line}", file=sys.stderr)
    return [line]
