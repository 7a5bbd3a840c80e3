"""Past one machine: torchrun with 2 "nodes" on localhost (c10d rendezvous), and the Slurm script
of `mbridge slurm` run with stand-in `srun`/`scontrol` (tests/scripts/fake_slurm) that start the two
nodes here: it trains, and a preempted job requeues and resumes exactly."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from factories import backend_for, source_tree_env

from megatron_bridge.cli.main import main as mbridge
from megatron_bridge.runtime.distributed import free_port

SCRIPTS = Path(__file__).parent / "scripts"
FAKE_SLURM = SCRIPTS / "fake_slurm"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra):
    """An environment that imports this source tree, outside any launcher or Slurm job."""
    env = {k: v for k, v in source_tree_env().items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def torchrun_node(*args, port, rdzv):
    """One "node" of a 2-node job on this machine: torchrun with 1 process, c10d rendezvous."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv}",
        *map(str, args),
    ]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_nodes_on_localhost_train_like_one_node(tmp_path):
    """Two torchrun processes (--nnodes 2, 1 process each) form one data-parallel job: global
    ranks 0 and 1 with node-local rank 0 on both, only the last global rank logs, and both nodes
    write their shards of the checkpoint."""
    train = [SCRIPTS / "train_tiny.py", "--iters", "6", "--backend", backend_for(2)]
    port, ckpt = free_port(), tmp_path / "ckpt"
    nodes = [
        subprocess.Popen(
            torchrun_node(*train, "--save", ckpt, "--out", tmp_path / "two", port=port, rdzv="two-nodes"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=clean_env(),
        )
        for _ in range(2)
    ]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)

    results = [json.loads((tmp_path / f"two.rank{r}").read_text()) for r in (0, 1)]
    launchers = [r["launcher"] for r in results]
    assert [(lr["RANK"], lr["LOCAL_RANK"], lr["WORLD_SIZE"], lr["LOCAL_WORLD_SIZE"]) for lr in launchers] == [
        ("0", "0", "2", "1"),
        ("1", "0", "2", "1"),
    ]
    assert {lr["GROUP_RANK"] for lr in launchers} == {"0", "1"}  # one rank per node
    for r in results:
        assert r["step"] == 6 and r["dp"] == 2 and len(r["losses"]) == 6
    assert results[0]["losses"] != results[1]["losses"]  # each rank trains on its half of the batch
    assert [r["logging_rank"] for r in results] == [False, True]
    # the node holding global rank 1 prints the progress lines, the other none
    by_rank = {("RANK=1" if "[100%] iteration 6/6" in o else "RANK=0"): o for o in outputs}
    assert set(by_rank) == {"RANK=0", "RANK=1"}
    assert "iteration" not in by_rank["RANK=0"]
    shards = sorted(p.name for p in (ckpt / "iter_0000006").glob("*.distcp"))
    assert shards[0].startswith("__0_") and shards[-1].startswith("__1_")  # written from both nodes


# ---------------------------------------------------------------------- Slurm
OVERRIDES = [
    "train.train_iters=16",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
    "logger.log_interval=1",
    "validation.eval_iters=0",
]


def write_script(tmp_path, name, *extra):
    script = tmp_path / f"{name}.sbatch"
    argv = [
        "slurm",
        "--recipe",
        "tiny_gpt_pretrain_config",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--cpu",
        "--dir",
        str(tmp_path / "runs"),
        "--name",
        name,
        "--log-dir",
        str(tmp_path / "logs"),
        "-o",
        str(script),
        *extra,
        *OVERRIDES,
    ]
    assert mbridge(argv) == 0
    return script


def slurm_env(tmp_path, job_id, restart=0):
    return clean_env(
        PATH=f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID=str(job_id),
        SLURM_JOB_NUM_NODES="2",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_RESTART_COUNT=str(restart),
        FAKE_SLURM_REQUEUES=str(tmp_path / "requeues"),
        MASTER_PORT=str(free_port()),
    )


def shard_sizes(run_dir, iteration):
    """Bytes of each rank's checkpoint file(s) of one iteration."""
    return {p.name: p.stat().st_size for p in (run_dir / "checkpoints" / f"iter_{iteration:07d}").glob("*.distcp")}


def losses(run_dir):
    from megatron_bridge.training.loggers.readback import read_tensorboard

    series = read_tensorboard(str(run_dir / "tb_logs")).series["lm loss"]
    return dict(zip(series.steps, series.values))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slurm_script_trains_and_a_preempted_job_requeues_and_resumes_exactly(tmp_path):
    # uninterrupted
    script = write_script(tmp_path, "straight")
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=400, env=slurm_env(tmp_path, 101)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "training stopped at iteration 16: completed" in done.stdout
    assert not (tmp_path / "requeues").exists()
    straight = losses(tmp_path / "runs" / "straight")
    assert sorted(straight) == list(range(1, 17))
    # fully_parallel_save (the default): the replicated weights are written half by each rank
    written = shard_sizes(tmp_path / "runs" / "straight", 16)
    assert sorted(written) == ["__0_0.distcp", "__1_0.distcp"] and written["__1_0.distcp"] > written["__0_0.distcp"] / 2

    # preempted: SIGTERM to the batch shell, as Slurm does, once training is under way; this job
    # writes its checkpoints from one rank and spreads their reading over both
    script = write_script(tmp_path, "preempted", "checkpoint.fully_parallel_save=False", "checkpoint.fully_parallel_load=True")
    log = tmp_path / "preempted.log"
    with open(log, "w") as out:
        job = subprocess.Popen(
            ["bash", str(script)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=slurm_env(tmp_path, 102),
            start_new_session=True,
        )
        deadline = time.time() + 300
        while "iteration  3/16" not in log.read_text() and job.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=200) == 0
    first = log.read_text()
    assert "SIGTERM received: asking the training processes to save a checkpoint and stop" in first
    assert "exit signal received" in first and "requeueing job 102" in first
    assert (tmp_path / "requeues").read_text() == "requeue 102\n"
    stopped = int(first.split("training stopped at iteration ")[1].split(":")[0])
    assert 3 <= stopped < 16
    # fully_parallel_save=False: rank 0 writes the replicated weights; rank 1 only its RNG state
    written = shard_sizes(tmp_path / "runs" / "preempted", stopped)
    assert written["__1_0.distcp"] < written["__0_0.distcp"] / 20

    # the requeued job: same script, same job id, next restart count
    again = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=400, env=slurm_env(tmp_path, 102, restart=1)
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resumed from iteration {stopped}" in again.stdout
    assert "(reading spread over 2 ranks)" in again.stdout  # fully_parallel_load
    assert "training stopped at iteration 16: completed" in again.stdout
    assert losses(tmp_path / "runs" / "preempted") == straight  # bit for bit


def test_slurm_script_for_gpus_with_container(tmp_path, capsys, caplog):
    argv = [
        "slurm",
        "--recipe",
        "llama3_70b_pretrain_config",
        "--nodes",
        "8",
        "--gpus-per-node",
        "8",
        "--time",
        "04:00:00",
        "--partition",
        "batch",
        "--container",
        "nvcr.io/nvidia/pytorch:25.01-py3",
        "--container-mounts",
        "/lustre:/lustre",
        "--dir",
        "/lustre/runs",
        "-o",
        "-",
        "optimizer.lr=1e-4",
    ]
    with caplog.at_level(logging.WARNING):
        assert mbridge(argv) == 0
    # checked for the GPU nodes, which have TransformerEngine: the recipe's tensor-parallel overlap stays
    assert "overlap turned off" not in caplog.text
    text = capsys.readouterr().out
    for line in (
        "#SBATCH --nodes=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --time=04:00:00",
        "#SBATCH --partition=batch",
        'export CUDA_DEVICE_MAX_CONNECTIONS="${',
    ):
        assert line in text
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3 --container-mounts=/lustre:/lustre" in text
    assert "--nproc-per-node=8" in text and "--rdzv-backend=c10d" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert " optimizer.lr=1e-4 " in text and " train.exit_signal_handler=true )" in text
    assert "# plan on H100 80GB: fits" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0  # valid shell
    assert f"#SBATCH --chdir={os.getcwd()}\n" in text  # relative paths mean paths here, wherever sbatch runs


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_slurm_script_runs_where_it_was_written_or_says_to_submit_from_there(tmp_path):
    """`#SBATCH --chdir` pins the directory the script's relative paths (runs/, slurm_logs/) were
    meant in; `cd jobs && sbatch ../t.sbatch` put them elsewhere. A directory an #SBATCH value
    cannot hold is named in a comment instead."""

    for name in ("plain", "with space"):
        here = tmp_path / name
        here.mkdir()
        argv = ["slurm", "--recipe", "tiny_gpt_pretrain_config", "--nodes", "2", "--gpus-per-node", "1", "--cpu", "-o", "-"]
        out = subprocess.run([sys.executable, "-m", "megatron_bridge", *argv], cwd=here, capture_output=True, text=True,
                             timeout=100, env=source_tree_env())  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        chdir = f"#SBATCH --chdir={here}\n"
        note = f"# submit this script from {here}: its relative paths and log directory mean paths there\n"
        assert (chdir in out.stdout, note in out.stdout) == ((True, False) if name == "plain" else (False, True))


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["train.exit_signal_handler=false"],
            "train.exit_signal_handler: false, but a requeued job resumes from the "
            "checkpoint saved on the exit signal (leave it unset",
        ),
        (
            ["checkpoint.save=null"],
            "checkpoint.save: is not set: a preempted job would start over when requeued (set checkpoint.save=DIR)",
        ),
        (["checkpoint.load=/elsewhere"], "checkpoint.load: '/elsewhere' differs from checkpoint.save="),
        (["--container-mounts", "/a:/a"], "--container-mounts needs --container IMAGE"),
        (["model.tensor_model_parallel_size=3"], "does not resolve at world size 8"),
    ],
)
def test_slurm_errors(capsys, tmp_path, extra, message):
    argv = [
        "slurm",
        "--recipe",
        "tiny_gpt_pretrain_config",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--cpu",
        "-o",
        str(tmp_path / "x.sbatch"),
        *extra,
    ]
    assert mbridge(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.sbatch").exists()


@pytest.mark.timeout(120)
def test_slurm_refuses_a_credential_written_into_the_script(tmp_path):
    script = tmp_path / "x.sbatch"
    argv = ["slurm", "--recipe", "tiny_gpt_pretrain_config", "--nodes", "2", "--gpus-per-node", "1", "--cpu",
            "--dir", str(tmp_path / "runs"), "-o", str(script)]  # fmt: skip
    literal = ["logger.comet_api_key=abc123secret", "++env_vars.HF_TOKEN=hf_abc123secret"]
    done = subprocess.run([sys.executable, "-m", "megatron_bridge", *argv, *literal], capture_output=True, text=True,
                          env=clean_env(), timeout=100)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "logger.comet_api_key, env_vars.HF_TOKEN: a credential given on the command line would be written" in done.stderr
    assert "${oc.env:COMET_API_KEY}" in done.stderr and "abc123secret" not in done.stdout + done.stderr
    assert not script.exists()
    # read from the job's environment, the value stays out of the script
    from_env = ["logger.comet_api_key=${oc.env:MB_TEST_COMET_KEY}"]
    done = subprocess.run([sys.executable, "-m", "megatron_bridge", *argv, *from_env], capture_output=True, text=True,
                          env=clean_env(MB_TEST_COMET_KEY="abc123secret"), timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = script.read_text()
    assert "'logger.comet_api_key=${oc.env:MB_TEST_COMET_KEY}'" in text and "abc123secret" not in text


@pytest.mark.timeout(120)
def test_slurm_refuses_values_that_would_break_out_of_their_line(tmp_path):
    script = tmp_path / "x.sbatch"
    argv = ["slurm", "--recipe", "tiny_gpt_pretrain_config", "--nodes", "1", "--gpus-per-node", "2", "--cpu",
            "--dir", str(tmp_path / "runs")]  # fmt: skip
    cases = [
        (["-o", str(script), "--partition", "batch\n#SBATCH --uid=0"],
         "--partition 'batch\\n#SBATCH --uid=0': an #SBATCH value is one word without spaces or control characters"),
        (["-o", str(script), "--time", "4h"], "--time '4h': not a Slurm time limit (give MM, HH:MM:SS"),
        (["--job-name", "../x"], "job name '../x' names the script file ../x.sbatch: give one without '/'"),
        (["-o", str(script), "logger.wandb_project=a\nNODE_EOF\nid"],
         "'logger.wandb_project=a\\nNODE_EOF\\nid': the sbatch script cannot hold a line break or control character"),
    ]  # fmt: skip
    for extra, message in cases:
        done = subprocess.run([sys.executable, "-m", "megatron_bridge", *argv, *extra], capture_output=True, text=True,
                              env=clean_env(), timeout=100, cwd=tmp_path)  # fmt: skip
        assert done.returncode == 2 and message in done.stderr, (extra, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
        assert not script.exists() and not (tmp_path.parent / "x.sbatch").exists()


@pytest.mark.timeout(120)
def test_slurm_refuses_a_time_limit_no_longer_than_the_checkpoint_warning(tmp_path):
    """`--time 00:01:00` with the default `--signal-seconds 120`: Slurm would warn the job as it
    starts, so it would checkpoint and requeue at once, on every requeue; the script was written."""
    script = tmp_path / "x.sbatch"
    argv = ["slurm", "--recipe", "tiny_gpt_pretrain_config", "--nodes", "1", "--gpus-per-node", "2", "--cpu",
            "--dir", str(tmp_path / "runs"), "-o", str(script), "--time", "00:01:00"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "megatron_bridge", *argv], capture_output=True, text=True,
                          env=source_tree_env(OMP_NUM_THREADS="1"), timeout=100, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "--signal-seconds 120 is not shorter than --time 00:01:00 (60 s): the job would be told to checkpoint and " \
        "requeue as it starts, and again each time it is requeued (give a longer --time, or a smaller " \
        "--signal-seconds)" in done.stderr  # fmt: skip
    assert not script.exists()
