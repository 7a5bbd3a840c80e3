"""Runs that cannot be lost: output paths checked before the model is built, a full disk named,
one job per save directory, no helper process outliving a killed trainer, Ctrl-C saving."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from factories import source_tree_env, tiny_config

from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.training import build
from megatron_bridge.training.callbacks import Callback
from megatron_bridge.training.checkpointing import lock, read_tracker
from megatron_bridge.training.config import DatasetProvider, TrainingConfig, ValidationConfig
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain

SCRIPT = Path(__file__).parent / "scripts" / "train_tiny.py"


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


def _script(*args):
    return [sys.executable, str(SCRIPT), *args]


def _config(save, iters=4):
    cfg = tiny_config(
        train=TrainingConfig(train_iters=iters, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
    )
    cfg.checkpoint.save = save
    return cfg


def _session_processes(sid):
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid:
                found.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    return found


def _process_tree(pid):
    """The process `pid` and its descendants (torchrun starts each rank in a session of its own)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _alive(processes):
    found = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _kill_session(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture
def no_model_building(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built although the config could not run")

    monkeypatch.setattr(build, "build_model", refuse)


def _read_only_dir(tmp_path):
    """A directory this process cannot write into (a read-only tmpfs for root)."""
    path = tmp_path / "readonly"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        return path, lambda: path.chmod(0o700)
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)]).returncode:
        pytest.skip("cannot make a read-only directory here")
    return path, lambda: subprocess.run(["umount", str(path)])


@pytest.mark.timeout(120)
def test_unwritable_save_paths_are_refused_before_the_model_is_built(tmp_path, no_model_building):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = {
        str(a_file): "is a file, not a directory",
        "/dev/null": "is a device or special file, not a directory",
        str(a_file / "ckpt"): f"lies under {a_file}, which is a file, not a directory",
    }
    readonly, undo = _read_only_dir(tmp_path)
    cases[str(readonly / "ckpt")] = "cannot be written"
    try:
        for save, reason in cases.items():
            with pytest.raises(ConfigValidationError) as info:
                pretrain(_config(save), forward_step)
            assert info.value.errors[0].startswith("checkpoint.save: "), info.value.errors
            assert reason in info.value.errors[0], info.value.errors
    finally:
        undo()


def test_a_name_longer_than_the_filesystem_allows_is_refused_before_writing(tmp_path):
    from megatron_bridge.training.preflight import unwritable_reason

    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    path = str(tmp_path / ("n" * (limit + 1)) / "checkpoints")
    for create in (False, True):
        assert unwritable_reason(path, create) == (
            f"{path}: the name {'n' * 40!r}... is {limit + 1} bytes, over the {limit} bytes its filesystem allows"
        )
    assert os.listdir(tmp_path) == []


def test_a_path_without_room_for_the_files_inside_it_is_refused_before_anything_is_made(tmp_path):
    """A save directory whose own path nearly fills PATH_MAX could be made, and its first
    checkpoint (`iter_N.incomplete/__0_0.distcp` inside it) could not: refused, and no partial
    directories are left."""
    from megatron_bridge.runtime.writable import INSIDE_BYTES
    from megatron_bridge.training.preflight import unwritable_reason

    limit = os.pathconf(tmp_path, "PC_PATH_MAX")
    path = str(tmp_path)
    while len(os.fsencode(path)) + INSIDE_BYTES < limit:
        path = os.path.join(path, "d" * 200)
    for create in (False, True):
        why = unwritable_reason(path, create)
        assert why is not None and f"the path is {len(os.fsencode(path)):,} bytes" in why, why
        assert f"passes the {limit:,} bytes this system allows for a path" in why
    assert os.listdir(tmp_path) == []
    assert unwritable_reason(str(tmp_path / "short" / "checkpoints"), create=False) is None


@pytest.mark.timeout(120)
def test_unwritable_tracker_directory_is_refused(tmp_path, no_model_building):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cfg = _config(None)
    cfg.logger.tensorboard_dir = str(a_file / "tb")
    with pytest.raises(ConfigValidationError, match=r"logger.tensorboard_dir: .* which is a file, not a directory"):
        pretrain(cfg, forward_step)


@pytest.mark.timeout(120)
def test_a_second_job_on_a_live_save_directory_is_refused(tmp_path, no_model_building):
    save = tmp_path / "ckpt"
    holder = lock.acquire(str(save))  # a live job: this process, holding the lock from another fd
    try:
        other = subprocess.run(
            [sys.executable, "-c", f"from megatron_bridge.training.checkpointing import lock; lock.acquire({str(save)!r})"],
            capture_output=True, text=True, env=_env(), timeout=60,
        )  # fmt: skip
        assert other.returncode != 0
        assert f"checkpoint.save={save} is in use by another job (host=" in other.stderr
        assert f"pid={os.getpid()} " in other.stderr
    finally:
        lock.release(holder)
    # and through pretrain(): a job running in another process
    job = subprocess.Popen(
        _script("--iters", "400", "--save", str(save), "--step-sleep", "0.05", "--out", str(tmp_path / "o")),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (save / lock.LOCK_FILE).exists() or not (save / lock.LOCK_FILE).read_text():
            assert time.time() < deadline and job.poll() is None, "the first job never took the lock"
            time.sleep(0.1)
        with pytest.raises(ConfigValidationError, match=rf"is in use by another job \(host=\S+ pid={job.pid} "):
            pretrain(_config(str(save)), forward_step)
    finally:
        _kill_session(job)


@pytest.mark.timeout(120)
def test_a_stale_lock_of_a_killed_job_is_taken_over(tmp_path, caplog):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / lock.LOCK_FILE).write_text("host=gone pid=999999 since=2026-01-01 00:00:00\n")
    caplog.set_level("INFO", logger="megatron_bridge")
    state = pretrain(_config(str(save), iters=2), forward_step)
    assert state.train_state.step == 2 and read_tracker(str(save)) == 2
    assert "left by a job that is no longer running (host=gone pid=999999" in caplog.text
    assert not (save / lock.LOCK_FILE).exists()  # released at the end


def _run_on_small_tmpfs(tmp_path, size, *args, then=""):
    """Train on a private tmpfs of `size` (`args`: more options of train_tiny.py); `then`: a shell
    command run after it, while the tmpfs is still mounted ($CKPT is the save directory)."""
    mount = tmp_path / "small"
    mount.mkdir()
    train = _script("--iters", "4", "--save", str(mount / "ckpt"), "--out", str(tmp_path / "o"), *args)
    script = " ".join([f"mount -t tmpfs -o size={size} tmpfs {mount} &&", "exec", *train])
    if then:
        script = " ".join([f"mount -t tmpfs -o size={size} tmpfs {mount} &&", *train, f"; status=$?; CKPT={mount / 'ckpt'}; {then}; exit $status"])
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode:
        pytest.skip("needs unshare -m to mount a private tmpfs")
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=_env(), timeout=240)


@pytest.mark.timeout(300)
def test_a_save_that_runs_out_of_space_says_so(tmp_path):
    result = _run_on_small_tmpfs(tmp_path, "400k")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "KiB free, but one checkpoint of this model takes about" in output  # the preflight warning
    assert "saving the checkpoint of iteration 4 to" in output and "no space left on the device" in output
    assert "one checkpoint takes about" in output


@pytest.mark.timeout(300)
def test_space_for_the_checkpoints_kept_at_once_is_checked_and_a_failed_save_frees_its_space(tmp_path):
    """Room for one checkpoint but not two, with most_recent_k=1: the second save needs both at
    once (the old one is deleted only after the new one is complete). The preflight says so before
    training; the save that fails removes what it wrote and leaves the tracker at the first one."""
    result = _run_on_small_tmpfs(
        tmp_path, "2400k", "--save-interval", "2", "--most-recent-k", "1",
        then='ls -a "$CKPT"; echo "tracker=$(cat "$CKPT"/latest_checkpointed_iteration.txt)"',
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "this run holds up to 2 new checkpoints of about" in output, output[-3000:]
    assert "(checkpoint.most_recent_k=1 kept, plus the one being written)" in output
    assert "saving the checkpoint of iteration 4 to" in output and "partly written one removed" in output
    listing = result.stdout.split()
    assert "iter_0000002" in listing and "tracker=2" in listing, result.stdout[-2000:]
    assert not [name for name in listing if name.endswith(".incomplete")], result.stdout[-2000:]


@pytest.mark.timeout(300)
def test_killing_the_trainer_during_an_async_save_leaves_no_process_behind(tmp_path):
    save = tmp_path / "ckpt"
    job = subprocess.Popen(
        _script("--iters", "400", "--save", str(save), "--save-interval", "2", "--async-save", "--out", str(tmp_path / "o")),
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 200
        while not list(save.glob("iter_*.incomplete")) or read_tracker(str(save)) is None:
            assert time.time() < deadline and job.poll() is None, "never caught a background save in progress"
            time.sleep(0.005)
        helpers = [p.pid for p in _session_processes(job.pid) if p.pid != job.pid]
        job.send_signal(signal.SIGKILL)  # the trainer only, as the OOM killer would
        job.wait()
        deadline = time.time() + 10
        while _session_processes(job.pid) and time.time() < deadline:
            time.sleep(0.2)
        left = [(p.pid, p.name()) for p in _session_processes(job.pid)]
        assert left == [], f"processes of the killed run remain: {left} (helpers seen before the kill: {helpers})"
    finally:
        _kill_session(job)


@pytest.mark.timeout(120)
def test_a_spawned_checkpoint_worker_dies_with_a_killed_trainer(tmp_path):
    """megatron-core's persistent checkpoint worker (spawned for async saves on a GPU run; a CPU
    run saves from forked processes) waits on its job queue for ever once its trainer is killed,
    unless the manager ties it to the trainer. A stand-in trainer spawns a worker the same way
    and is killed: the tied worker dies with it, an untied one lives on."""
    import inspect

    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    from megatron_bridge.runtime import child_processes
    from megatron_bridge.training.checkpointing.manager import DefaultCheckpointManager

    original = PersistentAsyncCaller.__dict__["async_loop"]
    cfg = _config(str(tmp_path / "ckpt"))
    cfg.checkpoint.async_save = True  # and use_persistent_ckpt_worker, its default
    try:
        DefaultCheckpointManager(cfg)._queue()
        tied = inspect.getattr_static(PersistentAsyncCaller, "async_loop")
        assert tied.func is child_processes._run_tied and tied.args == (os.getpid(), PersistentAsyncCaller, "async_loop")
    finally:
        PersistentAsyncCaller.async_loop = original

    lives_on = {}
    for mode in ("tied", "untied"):
        pid_file = tmp_path / f"{mode}.pid"
        trainer = subprocess.Popen(
            [sys.executable, str(SCRIPT.parent / "spawn_worker.py"), str(pid_file), mode],
            env=source_tree_env(), start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.time() + 60
            while not pid_file.exists():
                assert time.time() < deadline and trainer.poll() is None, f"the {mode} worker never started"
                time.sleep(0.05)
            worker = psutil.Process(int(pid_file.read_text()))
            trainer.kill()
            trainer.wait()
            deadline = time.time() + 5
            while _alive([worker]) and time.time() < deadline:
                time.sleep(0.1)
            lives_on[mode] = bool(_alive([worker]))
        finally:
            _kill_session(trainer)
    assert lives_on == {"tied": False, "untied": True}


def _signal_after_steps(tmp_path, sig, times, steps=3):
    save = tmp_path / "ckpt"
    out = tmp_path / "o"
    job = subprocess.Popen(
        _script("--iters", "500", "--save", str(save), "--exit-signal-handler", "--step-sleep", "0.05", "--out", str(out)),
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if f" {steps}/500 |" in line:
                for _ in range(times):
                    job.send_signal(sig)
                    time.sleep(0.01)
                break
        rest, _ = job.communicate(timeout=200)
    finally:
        _kill_session(job)
    return job.returncode, "".join(lines) + rest, save, out


def _terminate_this_process() -> None:
    """SIGTERM to this process, as a preemption sends it, once the run's handler is installed
    (without one the signal would end the test session)."""
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None), "no exit-signal handler installed"
    os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class _PreemptedWhileBuilt(DatasetProvider):
    """Random token windows; SIGTERM arrives while they are built (during the run's setup)."""

    seq_length: int = 32

    def build_datasets(self, context):
        import torch

        _terminate_this_process()
        texts = torch.randint(0, 256, (context.train_samples, 33), generator=torch.Generator().manual_seed(0))
        windows = [{"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(32), "position_ids": torch.arange(32)} for t in texts]
        return windows, None, None


class _PreemptedDuringEvaluation(Callback):
    def on_eval_start(self, state):
        _terminate_this_process()


@pytest.mark.timeout(120)
def test_a_signal_during_setup_stops_the_run_before_it_trains(tmp_path, caplog):
    cfg = _config(str(tmp_path / "ckpt"), iters=50)
    cfg.dataset = _PreemptedWhileBuilt(num_workers=0)
    cfg.train.exit_signal_handler = True
    caplog.set_level("INFO", logger="megatron_bridge")
    state = pretrain(cfg, forward_step)
    assert state.train_state.step == 0
    assert "training stopped at iteration 0: exit signal received before the first iteration" in caplog.text
    assert read_tracker(str(tmp_path / "ckpt")) is None  # nothing trained: nothing saved
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone with the run


@pytest.mark.timeout(120)
def test_a_signal_during_evaluation_stops_it_and_saves_at_once(tmp_path, caplog):
    cfg = _config(str(tmp_path / "ckpt"), iters=50)
    cfg.validation = ValidationConfig(eval_interval=2, eval_iters=40)
    cfg.train.exit_signal_handler = True
    caplog.set_level("INFO", logger="megatron_bridge")
    state = pretrain(cfg, forward_step, callbacks=[_PreemptedDuringEvaluation()])
    assert state.train_state.step == 2 and read_tracker(str(tmp_path / "ckpt")) == 2
    assert state.train_state.consumed_valid_samples == 0, "evaluation went on after the signal"
    assert "evaluation stopped after 0 of 40 batches: exit signal received" in caplog.text
    assert "training stopped at iteration 2: exit signal received" in caplog.text


@pytest.mark.timeout(300)
def test_ctrl_c_saves_and_exits_like_sigterm(tmp_path):
    code, output, save, out = _signal_after_steps(tmp_path, signal.SIGINT, times=1)
    assert code == 0, output[-3000:]
    assert "exit signal received" in output and "Traceback" not in output
    step = json.loads(Path(f"{out}.rank0").read_text())["step"]
    assert 3 <= step < 500 and read_tracker(str(save)) == step


@pytest.mark.timeout(300)
def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    code, output, save, out = _signal_after_steps(tmp_path, signal.SIGINT, times=2)
    assert code != 0
    assert "second Ctrl-C: aborting without saving" in output
    assert not Path(f"{out}.rank0").exists()


@pytest.mark.timeout(300)
def test_ctrl_c_without_the_handler_ends_the_cli_with_a_short_message(tmp_path):
    cmd = [sys.executable, "-m", "megatron_bridge", "pretrain", "--recipe", "tiny_gpt_pretrain_config", "--dir", str(tmp_path),
           "train.exit_signal_handler=false", "train.train_iters=2000", "logger.log_interval=1", "~logger.tensorboard_dir"]  # fmt: skip
    # Ctrl-C as a terminal delivers it, also when the suite itself runs as a background job
    # (which starts its children with SIGINT ignored)
    job = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if " 3/2000 |" in line:
                job.send_signal(signal.SIGINT)
                break
        rest, _ = job.communicate(timeout=200)
    finally:
        _kill_session(job)
    output = "".join(lines) + rest
    assert job.returncode == 130, output[-2000:]
    assert "mbridge pretrain: interrupted." in output and "Traceback" not in output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_whose_stdout_reader_ends_trains_on_without_tracebacks(tmp_path):
    """`mbridge pretrain ... | head -1`: the pipe's reader ends after one line; the run goes on to
    its checkpoint, saying once on stderr that its console lines are dropped."""
    cmd = [sys.executable, "-m", "megatron_bridge", "pretrain", "--recipe", "tiny_gpt_pretrain_config", "--dir", str(tmp_path),
           "train.train_iters=3", "logger.log_interval=1", "validation.eval_iters=1", "~logger.tensorboard_dir"]  # fmt: skip
    job = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        job.stdout.readline()
        job.stdout.close()  # as `head -1` exits
        _, stderr = job.communicate(timeout=200)
    finally:
        _kill_session(job)
    assert job.returncode == 0, stderr[-3000:]
    assert "Logging error" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "stdout was closed (the reader of its pipe ended); going on without console lines" in stderr
    assert read_tracker(str(tmp_path / "tiny_gpt_pretrain" / "checkpoints")) == 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killing_the_launcher_stops_every_process_of_the_job(tmp_path):
    """torchrun killed with -9: both ranks notice their launcher is gone and stop as on SIGTERM
    (the recipe's SIGTERM handler saves a checkpoint first); their tracker helper ends with them."""
    from factories import backend_overrides, torchrun


    cmd = [
        *torchrun(2), "-m", "megatron_bridge", "pretrain", "--recipe", "tiny_gpt_pretrain_config",
        "--dir", str(tmp_path), "train.train_iters=100000", "logger.log_interval=1", *backend_overrides(2),
    ]  # fmt: skip
    env = {k: v for k, v in _env().items() if k not in ("MASTER_ADDR", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, job_processes = [], []
    try:
        for line in job.stdout:
            lines.append(line)
            if " 3/100000 |" in line:
                break
        job_processes = _process_tree(job.pid)
        assert len(job_processes) >= 4, [p.name() for p in job_processes]  # torchrun, 2 ranks, the tracker worker
        job.send_signal(signal.SIGKILL)  # torchrun only
        killed = time.time()
        while _alive(job_processes) and time.time() < killed + 30:
            time.sleep(0.2)
        left = [(p.pid, " ".join(p.cmdline())[:100]) for p in _alive(job_processes)]
    finally:
        if not job_processes and job.poll() is None:
            job_processes = _process_tree(job.pid)
        for p in _alive(job_processes):
            p.kill()
        _kill_session(job)
    output = "".join(lines) + job.stdout.read()
    assert left == [], f"processes of the job remain 30 s after the launcher was killed: {left}\n{output[-3000:]}"
    assert "is gone: stopping as on SIGTERM" in output, output[-3000:]
    assert "exit signal received" in output, output[-3000:]
    saved = read_tracker(str(tmp_path / "tiny_gpt_pretrain" / "checkpoints"))
    assert saved is not None and saved >= 3
