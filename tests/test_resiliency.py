"""Resiliency on CPU: in-process restart, result validation, spiky loss, straggler settings."""

import logging
import os

import pytest
import torch
from factories import backend_for, needs, on_cpu, tiny_config

from megatron_bridge.training.callbacks import Callback
from megatron_bridge.runtime.child_processes import die_with_parent
from megatron_bridge.training.config import (
    CheckpointConfig,
    ConfigValidationError,
    InProcessRestartConfig,
    TrainingConfig,
    ValidationConfig,
    runtime_config_update,
)
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain

pytestmark = pytest.mark.timeout(400)


class Losses(Callback):
    def __init__(self):
        self.by_step = {}

    def on_step_end(self, state, metrics):
        self.by_step[state.train_state.step] = metrics["lm loss"]


def restart_config(save, **overrides):
    settings = dict(
        enabled=True, max_iterations=3, heartbeat_interval=2, heartbeat_timeout=20,
        soft_timeout=30, hard_timeout=40, barrier_timeout=60, completion_timeout=60,
    )  # fmt: skip
    settings.update(overrides)
    return tiny_config(
        train=TrainingConfig(train_iters=10, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
        checkpoint=CheckpointConfig(save=save, save_interval=5),
        inprocess_restart=InProcessRestartConfig(**settings),
    )


def test_inprocess_restart_resumes_from_the_last_checkpoint_and_finishes_like_an_unfaulted_run(tmp_path, caplog):
    needs("nvidia_resiliency_ext")
    # As after any earlier run in this process: forked helpers are tied to their parent. The
    # restart monitor (a double-forked daemon) must still start.
    die_with_parent()
    clean = Losses()
    # on CPU on every machine: the losses are compared bit for bit
    pretrain(on_cpu(restart_config(str(tmp_path / "clean"))), forward_step, callbacks=[clean])

    faults = []

    def fault_at_7(state, data_iterator, model):
        if state.train_state.step == 6 and not faults:
            faults.append(state.train_state.step + 1)
            raise RuntimeError("injected fault at iteration 7")
        return forward_step(state, data_iterator, model)

    faulted = Losses()
    with caplog.at_level(logging.INFO):
        state = pretrain(on_cpu(restart_config(str(tmp_path / "faulted"))), fault_at_7, callbacks=[faulted])
    assert faults == [7] and state.train_state.step == 10
    assert "in-process restart 1: resuming from the last checkpoint" in caplog.text
    assert "resumed from iteration 5" in caplog.text
    assert faulted.by_step == clean.by_step  # iterations 6..10 rerun from the checkpoint, identically
    assert not torch.distributed.is_initialized()


def test_inprocess_restart_refuses_an_existing_process_group(tmp_path):
    from megatron_bridge.runtime.distributed import single_process_store
    from megatron_bridge.training.resiliency.inprocess import ProcessGroupExistsError

    store = single_process_store()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ProcessGroupExistsError, match="a torch.distributed process group already exists"):
            pretrain(restart_config(str(tmp_path / "c")), forward_step)
    finally:
        torch.distributed.destroy_process_group()


def test_inprocess_restart_timeouts_must_be_ordered():
    cfg = restart_config(None, heartbeat_interval=30, heartbeat_timeout=20)
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg)
    assert (
        "inprocess_restart.heartbeat_interval: heartbeat_interval (30) must be shorter than heartbeat_timeout (20) "
        "(lower inprocess_restart.heartbeat_interval or raise inprocess_restart.heartbeat_timeout)"
    ) in err.value.errors


def validate_config(save, iters=8, **rerun):
    """Result validation on; `rerun` sets fields of the rerun_state_machine section."""
    cfg = tiny_config(
        train=TrainingConfig(train_iters=iters, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
        checkpoint=CheckpointConfig(save=save, load=save),
    )
    cfg.rerun_state_machine.rerun_mode = "validate_results"
    for name, value in rerun.items():
        setattr(cfg.rerun_state_machine, name, value)
    return cfg


def test_validate_results_classifies_a_transient_error(tmp_path, caplog):
    from megatron_bridge.training.checkpointing import read_tracker
    from megatron_bridge.training.runner import RerunExit

    with caplog.at_level(logging.WARNING), pytest.raises(RerunExit) as exit_info:
        # error_injection_rate=1: a fault in every validated result (0, the default, injects none)
        pretrain(validate_config(str(tmp_path / "ckpt"), error_injection_rate=1, error_injection_type="transient_error"), forward_step)
    assert exit_info.value.code == 17  # megatron-core's "failed on result validation"
    assert "unexpected result is not reproducible" in caplog.text and "Possible transient error" in caplog.text
    assert read_tracker(str(tmp_path / "ckpt")) == 1  # saved before the suspicious step's update
    assert not torch.distributed.is_initialized()


def test_validate_results_asks_to_rerun_a_reproducible_error_elsewhere(tmp_path, caplog):
    from megatron_bridge.training.checkpointing import read_tracker
    from megatron_bridge.training.runner import RerunExit

    ckpt = str(tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING), pytest.raises(RerunExit) as exit_info:
        pretrain(validate_config(ckpt, error_injection_rate=1, error_injection_type="persistent_error"), forward_step)
    assert exit_info.value.code == 16  # resume to disambiguate on another device
    assert "unexpected result is reproducible within the tolerance" in caplog.text
    assert "Need to rerun on a different GPU" in caplog.text
    assert read_tracker(ckpt) == 1
    # resuming re-runs the suspicious step from the checkpoint (here on the same device again)
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(RerunExit) as again:
        pretrain(validate_config(ckpt, error_injection_rate=1, error_injection_type="persistent_error"), forward_step)
    assert again.value.code == 16 and "Got rescheduled on the same GPU" in caplog.text


def test_spiky_loss_is_reported_and_training_goes_on(caplog):
    def spike_at_30(state, data_iterator, model):
        output, loss_func = forward_step(state, data_iterator, model)
        if state.train_state.step == 29:
            output = output * 1000.0
        return output, loss_func

    cfg = tiny_config(train=TrainingConfig(train_iters=32, global_batch_size=8, micro_batch_size=2))
    cfg.rerun_state_machine.check_for_spiky_loss = True
    cfg.rerun_state_machine.spiky_loss_factor = 10.0
    with caplog.at_level(logging.WARNING):
        state = pretrain(cfg, spike_at_30)
    assert state.train_state.step == 32
    spikes = [r.getMessage() for r in caplog.records if "spiky loss" in r.getMessage()]
    assert spikes and all("iteration 30" in m for m in spikes)


def test_straggler_detectors_are_refused_on_cpu_at_configuration_time():
    from megatron_bridge.training.config import NVRxStragglerDetectionConfig, StragglerDetectionConfig

    cfg = tiny_config(straggler=StragglerDetectionConfig(log_straggler=True), nvrx_straggler=NVRxStragglerDetectionConfig(enabled=True))
    on_cpu(cfg)
    with pytest.raises(ConfigValidationError) as err:
        pretrain(cfg, forward_step)
    # where nvidia-resiliency-ext is not installed, that is reported too
    package = "nvrx_straggler.enabled: NVRx straggler detection needs the 'nvidia_resiliency_ext' package"
    assert [e for e in err.value.errors if not e.startswith(package)] == [
        "straggler.log_straggler: megatron-core's straggler detector times GPU work with CUDA events, and this run "
        "trains on CPU (set straggler.log_straggler=False (or straggler=None) on CPU)",
        "nvrx_straggler.enabled: NVRx straggler detection profiles kernels with CUDA/CUPTI, and this run trains on CPU "
        "(set nvrx_straggler.enabled=False (or nvrx_straggler=None) on CPU)",
    ]
    assert not torch.distributed.is_initialized()  # refused before any process group


@pytest.mark.slow
def test_ft_launcher_restarts_after_a_simulated_rank_kill_and_the_job_completes(tmp_path):
    needs("nvidia_resiliency_ext")
    import json
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from megatron_bridge.runtime.distributed import free_port

    script = Path(__file__).parent / "scripts" / "train_tiny.py"
    launcher = os.path.join(os.path.dirname(sys.executable), "ft_launcher")
    ckpt, out = tmp_path / "ckpt", tmp_path / "o"
    # The fault clock starts at setup (5-14 s here, more on a loaded machine): 30 s lands after
    # the first checkpoint (iteration 2) and well before the 120 slowed-down iterations finish.
    # The restarted workers do not sleep, so the rest of the run is quick.
    cmd = [
        launcher, "--nproc-per-node=2", "--max-restarts=2", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(script),
        "--iters", "120", "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2", "--step-sleep", "0.3",
        "--fault-tolerance", "--simulate-fault", "rank_killed", "--fault-rank", "1", "--fault-delay", "30",
        "--backend", backend_for(2), "--out", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=360)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, output[-4000:]
    assert "simulated fault on rank 1" in output and "rank_killed" in output
    assert "Worker group UNHEALTHY" in output  # the launcher saw the kill and restarted the workers
    assert "resumed from iteration" in output  # ... which continued from the last checkpoint
    assert "training stopped at iteration 120: completed" in output
    assert json.loads(Path(f"{out}.rank0").read_text())["step"] == 120
