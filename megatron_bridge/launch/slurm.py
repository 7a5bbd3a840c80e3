"""An sbatch script that runs `torchrun -m megatron_bridge ...` on every node of a Slurm job and
requeues the job when it is preempted or reaches its time limit.

How a stop works: Slurm signals the batch shell (`--signal=B:USR1@N` ahead of the time limit, or
SIGTERM on preemption). The batch shell forwards the run's exit signal (SIGTERM unless
`train.exit_signal` says otherwise) through `srun` to one small wrapper per node, which sends it
to the training processes (the children of torchrun). Those finish the iteration, save a
checkpoint (`train.exit_signal_handler`) and exit cleanly; the batch shell then runs
`scontrol requeue`, and the requeued job resumes from that checkpoint. torchrun itself ignores the
signal: left to itself it would kill the training processes 30 s later, whatever they are doing.

Pure text generation: nothing here imports torch or talks to Slurm.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Optional

NCCL_ENV = (
    ("CUDA_DEVICE_MAX_CONNECTIONS", "1", "one hardware queue: TP/SP communication overlaps compute in order"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "a failed collective aborts instead of hanging"),
    ("TORCH_NCCL_AVOID_RECORD_STREAMS", "1", "free NCCL buffers without recordStream"),
    ("NCCL_DEBUG", "WARN", "NCCL reports problems only"),
    ("NCCL_NVLS_ENABLE", "0", "no NVLink SHARP buffers (they take GPU memory)"),
)
"""Environment each node sets unless the job's environment already does: (name, value, why)."""


@dataclass
class SlurmJob:
    """What the sbatch script launches and the resources it asks for."""

    command: list[str]
    """Arguments after `-m megatron_bridge` (subcommand, --recipe, overrides, ...)."""
    nodes: int
    gpus_per_node: int
    """Processes per node (one per GPU; on CPU nodes, processes)."""
    job_name: str = "mbridge"
    partition: Optional[str] = None
    account: Optional[str] = None
    time: Optional[str] = None
    container_image: Optional[str] = None
    container_mounts: Optional[str] = None
    log_dir: str = "slurm_logs"
    signal_seconds: int = 120
    """Seconds before the time limit at which Slurm warns the batch shell (USR1)."""
    exit_signal: str = "TERM"
    """The signal the training processes save-and-exit on (`train.exit_signal`, without SIG)."""
    python: str = "python"
    cpu: bool = False
    """No GPUs requested (processes per node = gpus_per_node)."""
    header_notes: list[str] = field(default_factory=list)
    """Comment lines put at the top (the plan, the command that wrote the script)."""
    workdir: Optional[str] = None
    """The directory the job runs in (`#SBATCH --chdir`): where the command's relative paths and
    `log_dir` were meant, whatever directory the script is submitted from."""


def render(job: SlurmJob) -> str:
    """The sbatch script of `job`."""
    sb = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if not job.cpu:
        sb.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    for flag, value in (("partition", job.partition), ("account", job.account), ("time", job.time)):
        if value:
            sb.append(f"#SBATCH --{flag}={value}")
    if job.workdir:
        sb.append(f"#SBATCH --chdir={job.workdir}")
    sb += [
        f"#SBATCH --output={job.log_dir}/%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{job.signal_seconds}",
        "",
        *(f"# {line}" if line else "#" for line in job.header_notes),
        "",
        "set -uo pipefail",
        "",
        "# Usual NCCL/CUDA settings; a value already in the job's environment wins.",
    ]
    for name, value, why in NCCL_ENV:
        sb.append(f'export {name}="${{{name}:-{value}}}"  # {why}')
    launcher = [
        job.python, "-m", "torch.distributed.run",
        '--nnodes="$SLURM_JOB_NUM_NODES"', f"--nproc-per-node={job.gpus_per_node}",
        "--rdzv-backend=c10d", '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
        '--rdzv-id="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"', "--max-restarts=0",
        "-m", "megatron_bridge", *(shlex.quote(a) for a in job.command),
    ]  # fmt: skip
    node_script = "\n".join([
        "# On each node: torchrun ignores the exit signal; this wrapper passes it to the training processes.",
        "export TORCHELASTIC_SIGNALS_TO_HANDLE=" + ",".join(
            s for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if s != f"SIG{job.exit_signal}"
        ),
        f"( trap '' {job.exit_signal}; exec " + _wrapped(launcher) + " ) &",
        "launcher=$!",
        f"trap 'pkill -{job.exit_signal} -P \"$launcher\" || true' {job.exit_signal}",
        'while :; do wait "$launcher"; status=$?; kill -0 "$launcher" 2>/dev/null || break; done',
        'exit "$status"',
    ])  # fmt: skip
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if job.container_image:
        srun.append(f"--container-image={shlex.quote(job.container_image)}")
        if job.container_mounts:
            srun.append(f"--container-mounts={shlex.quote(job.container_mounts)}")
    sb += [
        "",
        "# Rendezvous on the first node of the allocation; the port follows from the job id.",
        'MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"',
        'MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"',
        "export MASTER_ADDR MASTER_PORT",
        f"mkdir -p {shlex.quote(job.log_dir)}",
        'echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES nodes,"'
        ' "rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "",
        "read -r -d '' NODE_SCRIPT <<'NODE_EOF'",
        node_script,
        "NODE_EOF",
        "",
        "# Preemption (TERM) or the time-limit warning (USR1): the training processes save a checkpoint",
        "# and stop; the job is then requeued and resumes from it.",
        "stopping=0",
        "stop() {",
        "    stopping=1",
        '    echo "$1 received: asking the training processes to save a checkpoint and stop"',
        f'    if [ -n "${{srun_pid:-}}" ]; then kill -{job.exit_signal} "$srun_pid" 2>/dev/null; fi',
        "}",
        "trap 'stop SIGUSR1' USR1",
        "trap 'stop SIGTERM' TERM",
        "",
        " ".join(srun) + ' bash -c "$NODE_SCRIPT" &',
        "srun_pid=$!",
        'while :; do wait "$srun_pid"; status=$?; kill -0 "$srun_pid" 2>/dev/null || break; done',
        "",
        'if [ "$stopping" = 1 ]; then',
        '    echo "requeueing job $SLURM_JOB_ID: it resumes from the checkpoint just saved (exit status $status)"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(sb) + "\n"


def _wrapped(words: list[str], width: int = 100) -> str:
    """`words` joined by spaces, continued on indented lines (backslash) past `width` columns."""
    lines, current = [], ""
    for word in words:
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = "    " + word
        else:
            current = f"{current} {word}" if current else word
    lines.append(current)
    return " \\\n".join(lines)
