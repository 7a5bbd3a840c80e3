"""Launches that cannot work are refused before anything is built: NCCL with more processes on a
machine than visible GPUs, or a local rank past them (training, `mbridge hf import|export`, the
Slurm script); and `dist.distributed_backend=gloo` trains on CPU also where GPUs are visible."""

import os
import subprocess
import sys

import pytest
import torch
from factories import tiny_config, torchrun

from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.runtime import cpu_backend
from megatron_bridge.runtime.distributed import launch_problem, run_backend

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def clean_env():
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}


def test_two_processes_on_one_gpu_name_both_counts_and_both_ways_out():
    problem = launch_problem(visible_gpus=1, local_rank=0, local_world_size=2, backend="nccl")
    assert str(problem) == (
        "dist.distributed_backend: nccl needs one GPU per process, but this machine runs 2 processes "
        "(LOCAL_WORLD_SIZE) and has 1 visible GPU (torch.cuda.device_count()) (launch one process per GPU "
        "(torchrun --nproc_per_node=1), or set dist.distributed_backend=gloo to train on CPU)"
    )
    # the default backend picks NCCL where a GPU is visible, so it is refused alike
    auto = launch_problem(visible_gpus=1, local_rank=1, local_world_size=2, backend="auto")
    assert auto.message.startswith("auto (nccl where GPUs are visible) needs one GPU per process")
    # the second process alone: its local rank is past the one GPU
    past = launch_problem(visible_gpus=1, local_rank=1, local_world_size=1, backend="nccl")
    assert str(past) == (
        "dist.distributed_backend: nccl puts each process on the GPU of its local rank, but local rank 1 is past "
        "the 1 visible GPU (devices 0 to 0) (launch one process per GPU (torchrun --nproc_per_node=1), or set "
        "dist.distributed_backend=gloo to train on CPU)"
    )


def test_possible_launches_pass():
    assert launch_problem(visible_gpus=1, local_rank=0, local_world_size=1, backend="nccl") is None
    assert launch_problem(visible_gpus=8, local_rank=7, local_world_size=8, backend="auto") is None
    assert launch_problem(visible_gpus=1, local_rank=0, local_world_size=2, backend="gloo") is None
    assert launch_problem(visible_gpus=0, local_rank=0, local_world_size=4, backend="auto") is None  # gloo on CPU
    # a launcher that gives each process only its own GPU (CUDA_VISIBLE_DEVICES per process)
    assert launch_problem(visible_gpus=1, local_rank=5, local_world_size=8, backend="nccl", gpu_per_process=True) is None


def test_nccl_without_a_gpu_and_another_setting_name():
    problem = launch_problem(visible_gpus=0, local_rank=0, local_world_size=1, backend="nccl", setting="--backend")
    assert str(problem) == (
        "--backend: nccl needs one GPU per process, but this machine runs 1 process (LOCAL_WORLD_SIZE) and has "
        "0 visible GPUs (torch.cuda.device_count()) (run where GPUs are visible, or set --backend=gloo to train on CPU)"
    )
    assert launch_problem(visible_gpus=0, local_rank=0, local_world_size=1, backend="nccl", gpu_per_process=True)


def test_a_run_reads_the_launch_from_its_environment(monkeypatch):
    """`run_backend`: this machine's GPU count, LOCAL_WORLD_SIZE and the local rank (dist.local_rank
    or LOCAL_RANK) go into the check; gloo is never refused."""
    cfg = tiny_config()
    visible = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(visible + 1))
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg.dist.distributed_backend = "nccl"
    with pytest.raises(ConfigValidationError) as err:
        run_backend(cfg.dist)
    assert f"runs {visible + 1} process" in str(err.value) and f"has {visible} visible GPU" in str(err.value)
    cfg.dist.distributed_backend = "gloo"
    assert run_backend(cfg.dist) == "gloo"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_local_rank_minus_one_means_a_single_process(tmp_path):
    """The Hugging Face and DeepSpeed tools export LOCAL_RANK=-1 for "not one of several
    processes": a plain run in such a shell trains (it was refused as not a whole number)."""
    from megatron_bridge.runtime.launcher_env import launcher_int

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env["LOCAL_RANK"] = "-1"
    out = subprocess.run(
        [sys.executable, "-m", "megatron_bridge", "pretrain", "--recipe", "tiny_gpt_pretrain_config", "--dir", str(tmp_path),
         "train.train_iters=2", "validation.eval_iters=0", "checkpoint.save=null"],
        env=env, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "training stopped at iteration 2: completed" in out.stdout + out.stderr
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCAL_RANK", "-1")
        assert launcher_int("LOCAL_RANK", 0) == 0
        with pytest.raises(KeyError):
            launcher_int("LOCAL_RANK")  # as when it is unset
        mp.setenv("LOCAL_RANK", "-2")
        with pytest.raises(ConfigValidationError, match="LOCAL_RANK: '-2' is not a whole number of at least 0"):
            launcher_int("LOCAL_RANK", 0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_with_more_processes_than_gpus_exits_2_with_the_message(tmp_path):
    """More processes than this machine's GPUs with NCCL: the processes stop with exit status 2 and
    the launch error before building anything (torchrun reports the first to stop, ends the
    others, and exits 1 itself)."""

    visible = torch.cuda.device_count()
    nproc = max(2, visible + 1)
    cmd = [
        *torchrun(nproc), "-m", "megatron_bridge", "pretrain", "--recipe", "tiny_gpt_pretrain_config",
        "--dir", str(tmp_path), "dist.distributed_backend=nccl",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=clean_env())
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "exitcode  : 2" in output, output[-3000:]
    expected = (
        f"mbridge pretrain: error: 1 configuration problem:\n  - dist.distributed_backend: nccl needs one GPU per "
        f"process, but this machine runs {nproc} processes (LOCAL_WORLD_SIZE) and has {visible} visible GPU"
    )
    assert expected in output, output[-3000:]
    assert "dist.distributed_backend=gloo to train on CPU" in output
    assert output.count("Traceback (most recent call last)") == 1  # torchrun's own ChildFailedError only
    assert not (tmp_path / "tiny_gpt_pretrain").exists()  # nothing was built or written


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hf_import_with_more_processes_than_gpus_exits_2(tmp_path):
    from hf_models import save_tiny


    source = save_tiny("llama", str(tmp_path / "hf"))
    visible = torch.cuda.device_count()
    nproc = max(2, visible + 1)
    cmd = [
        *torchrun(nproc), "-m", "megatron_bridge", "hf", "import", source, str(tmp_path / "ckpt"),
        "--tp", str(nproc), "--backend", "nccl",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=clean_env())
    output = proc.stdout + proc.stderr
    assert "exitcode  : 2" in output, output[-3000:]
    assert f"--backend: nccl needs one GPU per process, but this machine runs {nproc} processes" in output
    assert "or set --backend=gloo to train on CPU" in output
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow  # several fresh processes
@pytest.mark.timeout(120)
def test_slurm_script_backend_matches_the_nodes_it_asks_for(tmp_path):
    """--cpu nodes train with gloo, asked for explicitly in the script; NCCL on CPU nodes, or
    gloo on GPU nodes, is refused when the script is written."""
    base = [sys.executable, "-m", "megatron_bridge", "slurm", "--recipe", "tiny_gpt_pretrain_config", "--nodes", "1",
            "--gpus-per-node", "2", "--dir", str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    cases = {
        "cpu_nccl": (["--cpu", "-o", "-", "dist.distributed_backend=nccl"],
                     "dist.distributed_backend: 'nccl' trains on GPUs, but --cpu asks for nodes without GPUs"),
        "gpu_gloo": (["-o", "-", "dist.distributed_backend=gloo"],
                     "dist.distributed_backend: 'gloo' trains on CPU, but the script asks for 2 GPUs per node (add --cpu"),
    }  # fmt: skip
    for name, (extra, message) in cases.items():
        proc = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=100, env=clean_env())
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        assert message in proc.stderr, (name, proc.stderr[-2000:])
    proc = subprocess.run([*base, "--cpu", "-o", "-"], capture_output=True, text=True, timeout=100, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dist.distributed_backend=gloo" in proc.stdout and "--nproc-per-node=2" in proc.stdout


def test_gloo_on_a_machine_with_gpus_hides_them_from_megatron_core(monkeypatch):
    """A CPU run where CUDA is available (`activate("cpu")`): megatron-core sees no GPU while the
    backend is active, and everything is restored after. The GPU is pretended here (none on CPU
    machines); the GPU lane trains this way for real."""
    real = {name: getattr(torch.cuda, name) for name in ("is_available", "device_count")}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    pretended = {name: getattr(torch.cuda, name) for name in ("is_available", "device_count")}
    assert cpu_backend.activate() is False  # by default only where no GPU is visible
    assert cpu_backend.activate("cuda") is False
    assert cpu_backend.activate("cpu") is True
    try:
        assert torch.cuda.is_available() is False and torch.cuda.device_count() == 0
        assert torch.zeros(2, device="cuda").device.type == "cpu"
    finally:
        cpu_backend.deactivate()
    assert {name: getattr(torch.cuda, name) for name in pretended} == pretended
    assert pretended != real


def test_gpu_only_settings_of_a_cpu_run_on_a_gpu_machine_point_to_the_gpus(monkeypatch):
    """A gloo run where GPUs are visible (pretended here) refuses GPU-only settings, and says to
    train on the GPUs instead."""
    from megatron_bridge.config import status as field_status

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = tiny_config()
    cfg.model.enable_cuda_graph = True
    assert field_status.machine_problems(cfg, device="cuda") == []
    assert field_status.machine_problems(cfg, device="cpu") == [
        "model.enable_cuda_graph: enable_cuda_graph=True needs a GPU (CUDA graphs) "
        "(train on the GPUs (dist.distributed_backend=auto or nccl), or leave it unset)"
    ]


@pytest.mark.timeout(120)
def test_slurm_checks_the_exit_signal_as_the_job_uses_it(tmp_path):
    """The script turns train.exit_signal_handler on, so a config that leaves it unset may pick
    its signal: the job's config is checked with the handler on."""
    recipe = os.path.join(os.path.dirname(__file__), "factories.py") + ":tiny_config"
    cmd = [sys.executable, "-m", "megatron_bridge", "slurm", "--recipe", recipe, "--cpu", "--nodes", "1",
           "--gpus-per-node", "1", "--log-dir", str(tmp_path / "logs"), "-o", "-", "train.exit_signal=SIGUSR1",
           f"checkpoint.save={tmp_path / 'ckpt'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "train.exit_signal_handler=true" in proc.stdout and "pkill -USR1" in proc.stdout
