"""progress.txt (logger.log_progress), the model-FLOPs counter, params-norm, and the GPU-only
energy setting."""

import math

import pytest
import torch
from factories import on_cpu, tiny_config

from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.models.param_count import flops_per_token
from megatron_bridge.training.callbacks import Callback
from megatron_bridge.training.config import CheckpointConfig, LoggerConfig, TrainingConfig, ValidationConfig
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain

pytestmark = pytest.mark.timeout(300)


class TrackerSpy(Callback):
    """Keeps what the logging rank sends to its tracker, and the weights' norm at the end."""

    def __init__(self):
        self.logged = []
        self.final_norm = None

    def on_train_start(self, state):
        send = state.tracker.log_metrics

        def record(metrics, step):
            self.logged.append((step, dict(metrics)))
            send(metrics, step)

        state.tracker.log_metrics = record

    def on_train_end(self, state):
        squares = sum(float(p.detach().float().pow(2).sum()) for chunk in state.model for p in chunk.parameters())
        self.final_norm = math.sqrt(squares)


def config(ckpt, iters, **logger):
    return tiny_config(
        train=TrainingConfig(train_iters=iters, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        checkpoint=CheckpointConfig(save=ckpt, load=ckpt, save_interval=2),
        logger=LoggerConfig(log_interval=1, **logger),
    )


def fields(line):
    parts = line.split("\t")
    return parts[3], dict(p.split(": ", 1) for p in parts[1:] if ": " in p)


def test_progress_file_follows_jobs_checkpoints_and_flops(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    cfg = config(ckpt, 6, log_progress=True)
    cfg.train.exit_interval = 4  # the first job stops at 4 ...
    pretrain(cfg, forward_step)
    per_step = flops_per_token(cfg.model) * cfg.model.seq_length * 8
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    pretrain(config(ckpt, 6, log_progress=True), forward_step)  # ... and a second one resumes there

    lines = [fields(line) for line in (tmp_path / "ckpt" / "progress.txt").read_text().splitlines()]
    events = [(event, f["iteration"]) for event, f in lines]
    assert events == [
        ("Starting job", "0"), ("Saved checkpoint", "2"), ("Saved checkpoint", "4"), ("Job finished (exit_interval=4 reached)", "4"),
        ("Starting job", "4"), ("Saved checkpoint", "6"), ("Job finished (completed)", "6"),
    ]  # fmt: skip
    first_job, second_job = lines[:4], lines[4:]
    assert {f["job"] for _, f in first_job} == {"100"} and {f["job"] for _, f in second_job} == {"101"}
    assert float(first_job[-1][1]["model FLOPs"]) == pytest.approx(4 * per_step, rel=1e-3)
    # the counter is restored from the checkpoint, so the second job starts where the first ended
    assert float(second_job[0][1]["model FLOPs"]) == pytest.approx(4 * per_step, rel=1e-3)
    assert float(second_job[-1][1]["model FLOPs"]) == pytest.approx(6 * per_step, rel=1e-3)
    assert second_job[-1][1]["samples"] == "48" and second_job[-1][1]["tokens"] == str(48 * 32)
    assert float(second_job[-1][1]["job throughput"].split()[0]) > 0


def test_progress_records_a_failed_job(tmp_path):
    def failing(state, data_iterator, model):
        if state.train_state.step == 3:
            raise RuntimeError("boom")
        return forward_step(state, data_iterator, model)

    with pytest.raises(RuntimeError, match="boom"):
        pretrain(config(str(tmp_path / "ckpt"), 6, log_progress=True), failing)
    last = (tmp_path / "ckpt" / "progress.txt").read_text().splitlines()[-1]
    assert fields(last)[0] == "Job failed (RuntimeError)" and fields(last)[1]["iteration"] == "3"


def test_params_norm_is_the_norm_of_the_weights():
    spy = TrackerSpy()
    cfg = tiny_config(
        train=TrainingConfig(train_iters=3, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        logger=LoggerConfig(log_interval=1, log_params_norm=True),
    )
    pretrain(cfg, forward_step, callbacks=[spy])
    norms = [m["params-norm"] for _, m in spy.logged]
    assert len(norms) == 3 and len(set(norms)) == 3  # logged every step, and training moves it
    assert norms[-1] == pytest.approx(spy.final_norm, rel=1e-6)


def test_params_norm_is_off_by_default():
    spy = TrackerSpy()
    cfg = tiny_config(train=TrainingConfig(train_iters=2, global_batch_size=8, micro_batch_size=2), logger=LoggerConfig(log_interval=1))
    pretrain(cfg, forward_step, callbacks=[spy])
    assert spy.logged and all("params-norm" not in m for _, m in spy.logged)


def test_progress_without_a_checkpoint_directory_and_energy_on_cpu_are_config_errors():
    cfg = on_cpu(tiny_config(logger=LoggerConfig(log_progress=True, log_energy=True)))
    with pytest.raises(ConfigValidationError) as err:
        pretrain(cfg, forward_step)
    assert (
        "logger.log_progress: progress.txt is written into the checkpoint directory, and checkpoint.save is not set "
        "(set checkpoint.save, or logger.log_progress=False)"
    ) in err.value.errors
    assert (
        "logger.log_energy: energy is read from GPU counters (NVML), but this run trains on CPU "
        "(set logger.log_energy=False on CPU)"
    ) in err.value.errors
    assert not torch.distributed.is_initialized()
