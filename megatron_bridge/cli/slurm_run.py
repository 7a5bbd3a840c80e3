"""`mbridge slurm`, run: build and check the config, plan it, and write the sbatch script (the
command's parser is `cli.slurm`)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import sys
from typing import Any, Optional

from megatron_bridge.cli import source
from megatron_bridge.cli.dry_run import for_target, resolve
from megatron_bridge.cli.errors import UsageError, config_errors_are_usage_errors
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.secrets import conceal_argv
from megatron_bridge.launch.slurm import SlurmJob, render
from megatron_bridge.planning import PlanningError, plan
from megatron_bridge.runtime.writable import unwritable_reason


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


def _refuse_literal_credentials(args: argparse.Namespace) -> None:
    """The script is a file that others can read and Slurm keeps a copy of: a credential given as
    a literal override value would be written into both."""
    given = [*args.overrides, *args.recipe_args]
    leaked = [arg for arg, shown in zip(given, conceal_argv(given)) if shown != arg]
    if leaked:
        keys = ", ".join(arg.partition("=")[0].lstrip("+~") for arg in leaked)
        raise UsageError(
            f"{keys}: a credential given on the command line would be written into the sbatch script; "
            "read it from the job's environment instead, e.g. logger.comet_api_key='${oc.env:COMET_API_KEY}', "
            "and export the variable before sbatch (jobs inherit the submitting shell's environment)"
        )


SLURM_TIME = re.compile(r"(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2}|UNLIMITED|unlimited|INFINITE|infinite)")
"""The forms of #SBATCH --time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, UNLIMITED."""


def _check_script_values(args: argparse.Namespace, job_name: str) -> None:
    """Values written into the script stay where they are put: a line break or other control
    character would end an #SBATCH line, the comment or the node script's here-document early and
    turn the rest into directives or commands; an #SBATCH value ends at whitespace."""
    words = {"job name (--job-name, else the run name)": job_name, "--partition": args.partition, "--account": args.account, "--time": args.time,
             "--log-dir": args.log_dir}  # fmt: skip
    for flag, value in words.items():
        if value is not None and (not value or any(c.isspace() or not c.isprintable() for c in value)):
            raise UsageError(f"{flag} {value!r}: an #SBATCH value is one word without spaces or control characters")
    if "/" in job_name and not args.output:
        raise UsageError(f"job name {job_name!r} names the script file {job_name}.sbatch: give one without '/' (--job-name)")
    if args.time is not None and not SLURM_TIME.fullmatch(args.time):
        raise UsageError(f"--time {args.time!r}: not a Slurm time limit (give MM, HH:MM:SS, D-HH:MM:SS or UNLIMITED)")
    limit = time_limit_seconds(args.time) if args.time is not None else None
    if limit is not None and args.signal_seconds >= limit:  # Slurm would signal at once, every requeue again
        raise UsageError(
            f"--signal-seconds {args.signal_seconds} is not shorter than --time {args.time} ({limit} s): the job would "
            "be told to checkpoint and requeue as it starts, and again each time it is requeued (give a longer --time, "
            "or a smaller --signal-seconds)"
        )


def time_limit_seconds(text: str) -> Optional[int]:
    """Seconds of a Slurm time limit in one of `SLURM_TIME`'s forms; None for no limit (UNLIMITED, 0)."""
    if not text[0].isdigit():
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:  # HH:MM:SS
        hours, minutes, seconds = parts
    elif len(parts) == 2:  # MM:SS
        hours, minutes, seconds = 0, *parts
    else:  # MM
        hours, minutes, seconds = 0, parts[0], 0
    total = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    return total or None


def _check_printable(values: list[Any]) -> None:
    """The words of the script's commands hold no line break or other control character (see
    `_check_script_values`)."""
    for value in values:
        if isinstance(value, str) and not value.isprintable():
            raise UsageError(
                f"{value!r}: the sbatch script cannot hold a line break or control character in a command "
                "(put such a value in a --config-file; the job reads that file)"
            )


def _shown(argv: list[str]) -> str:
    """A command line as a shell would read it, on one comment line."""
    text = " ".join(shlex.quote(a) for a in argv)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def run(args: argparse.Namespace) -> int:
    if args.container_mounts and not args.container:
        raise UsageError("--container-mounts needs --container IMAGE")
    _check_script_values(args, args.job_name or args.name or (args.recipe or "mbridge").removesuffix("_config"))
    _refuse_literal_credentials(args)
    # before the config is built, whose own checks (an optional package missing here) would
    # otherwise answer first and hide the refusal
    _check_printable([*args.overrides, *args.recipe_args])
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
    t.exit_signal_handler = True  # as the job runs it (the override above), so its exit_signal is checked as used
    resolve(cfg, world, target_te=target_te)
    job_name = args.job_name or args.name or (args.recipe or "mbridge").removesuffix("_config")  # as checked above
    notes = [
        "Written by: mbridge slurm " + _shown(sys.argv[2:] if sys.argv[1:2] == ["slurm"] else sys.argv[1:]),
        f"{args.nodes} nodes x {args.gpus_per_node} {'processes' if args.cpu else 'GPUs'} = {world} ranks",
    ]
    if not args.cpu:
        with for_target(target_te):
            notes += _plan_notes(cfg, args.gpu, job_name)
    command = _command(args, mode, extra)
    _check_printable([args.container, args.container_mounts, *command])
    workdir = _workdir(notes)
    job = SlurmJob(
        command=command,
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
        workdir=workdir,
    )
    text = render(job)
    if args.output == "-":
        print(text, end="")
        return 0
    path = args.output or f"{job_name}.sbatch"
    unwritable = unwritable_reason(args.log_dir, create=True)  # Slurm opens --output before the script runs
    if unwritable:
        raise UsageError(
            f"--log-dir: {unwritable} (give a directory this user can write, on a filesystem the nodes share)"
        )
    try:
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
    except OSError as exc:
        raise UsageError(
            f"--output: cannot write the script to {path}: {exc.strerror} (give a writable file path, or - for stdout)"
        ) from None
    print(f"wrote {path}; submit it with: sbatch {path}")
    return 0


def _plan_notes(cfg: Any, gpu: str, label: str) -> list[str]:
    """The plan's verdict as comment lines (a warning on stderr when it does not fit)."""
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


def _workdir(notes: list[str]) -> Optional[str]:
    """This directory, for `#SBATCH --chdir`: the script's relative paths mean paths here. A
    directory an #SBATCH value cannot hold (whitespace) is left out, with a note to submit from it."""
    here = os.getcwd()
    if any(c.isspace() or not c.isprintable() for c in here):
        shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in here)
        notes.append(f"submit this script from {shown}: its relative paths and log directory mean paths there")
        return None
    return here
