"""`mbridge slurm`: write an sbatch script that trains a recipe on N nodes and requeues itself."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any


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


def run(args: argparse.Namespace) -> int:
    """`mbridge slurm` (`slurm_run.run`): loaded only when the command runs, so `--help` stays light."""
    from megatron_bridge.cli import slurm_run

    return slurm_run.run(args)
