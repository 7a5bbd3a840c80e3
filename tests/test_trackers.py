"""Experiment trackers on a real tiny training run (CPU), read back from what each backend wrote.

MLflow runs on a sqlite file, Comet and W&B offline into temp dirs, TensorBoard into event files;
nothing reaches a remote service.
"""

import glob
import json
import math
import os
import re
import struct
import subprocess
import sys
import time
import zipfile
from multiprocessing.connection import Connection

import pytest
from factories import needs, on_cpu, tiny_config

from megatron_bridge.training.config import CheckpointConfig, LoggerConfig, TrainingConfig, ValidationConfig
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.loggers.base import Record
from megatron_bridge.training.loggers.factory import TrackerSpec
from megatron_bridge.training.pretrain import pretrain

TRAIN = {
    "lm loss", "learning-rate", "iteration-time", "tokens-per-second", "batch-size", "consumed-samples",
    "skipped-iterations", "nan-iterations", "grad-norm", "loss-scale",
}  # fmt: skip
EVAL = {"lm loss validation", "lm loss test"}


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker offline, into temp dirs (see docs/trackers-offline.md)."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "false")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        path = tmp_path / name.lower()
        path.mkdir()
        monkeypatch.setenv(name, str(path))
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.comet.config or ~/.netrc of the machine
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is relative to the working dir
    return tmp_path


def all_trackers(tmp_path, **extra) -> LoggerConfig:
    return LoggerConfig(
        log_interval=2,
        tensorboard_dir=str(tmp_path / "tb"),
        wandb_project="tiny",
        wandb_exp_name="run-a",
        wandb_save_dir=str(tmp_path / "wandb"),
        mlflow_experiment="tiny",
        mlflow_run_name="run-a",
        mlflow_tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        mlflow_tags={"team": "bridge"},
        comet_project="tiny",
        comet_experiment_name="run-a",
        comet_offline_directory=str(tmp_path / "comet"),
        comet_tags=["cpu"],
        **extra,
    )


# ---------------------------------------------------------------------- reading back
def read_tensorboard(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def read_mlflow(uri, experiment):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics
    }
    return run, {k: sorted(v) for k, v in history.items()}


def read_wandb(save_dir):
    """History rows, config and entity of the one offline run under `save_dir`, parsed from its
    `.wandb` record file (W&B 0.31 has no public reader): a LevelDB-style log of protobuf records."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, pos, pending, raw = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            raw.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            raw.append(pending + chunk)
    history, config, entity = {}, {}, None
    for item in raw:
        record = pb.Record()
        record.ParseFromString(item)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            step = record.history.step.num
            for entry in record.history.item:
                key = entry.key or "/".join(entry.nested_key)
                if not key.startswith("_"):
                    history.setdefault(key, []).append((step, json.loads(entry.value_json)))
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            config.update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates})
            entity = record.run.entity if kind == "run" else entity
    return history, config, entity


def read_comet(directory):
    """Metrics, parameters, other values and the experiment's description (workspace, project)
    of the one offline experiment in `directory`."""
    (path,) = glob.glob(os.path.join(directory, "*.zip"))
    archive = zipfile.ZipFile(path)
    lines = archive.read("messages.json").decode().splitlines()
    metrics, params, others = {}, {}, {}
    for line in lines:
        message = json.loads(line)
        payload = message["payload"]
        if message["type"] == "metric_msg":
            m = payload["metric"]
            metrics.setdefault(m["metricName"], []).append((m["step"], float(m["metricValue"])))
        elif message["type"] == "parameter_msg" and "param" in payload:  # ("params": Comet's own lists)
            params[payload["param"]["paramName"]] = payload["param"]["paramValue"]
        elif message["type"] == "log_other":
            others[payload["key"]] = payload["value"]
    return metrics, params, others, json.loads(archive.read("experiment.json"))


def console_losses(text):
    return {int(step): float(v) for step, v in re.findall(r"iteration +(\d+)/\d+ \|.*?\| lm loss ([0-9.E+-]+)", text)}


# ---------------------------------------------------------------------- end to end
@pytest.mark.timeout(300)
def test_all_four_trackers_record_the_same_metrics(offline, caplog):
    needs("mlflow", "wandb", "comet_ml")
    tmp = offline
    cfg = tiny_config(
        train=TrainingConfig(train_iters=6, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=3, eval_iters=1),
        checkpoint=CheckpointConfig(save=str(tmp / "ckpt")),
        logger=all_trackers(
            tmp,
            log_throughput=True,
            log_memory_to_tensorboard=True,
            log_timers_to_tensorboard=True,
            timing_log_level=1,
            log_world_size_to_tensorboard=True,
            log_validation_ppl_to_tensorboard=True,
            wandb_entity="bridge-team",  # recorded offline; online, the W&B team the run goes to
            comet_workspace="bridge-workspace",
            mlflow_log_checkpoints=True,
        ),
    )
    with caplog.at_level("INFO", logger="megatron_bridge"):
        pretrain(on_cpu(cfg), forward_step)  # the metrics of a CPU run (memory as RSS, no MFU) on every machine
    console = console_losses(caplog.text)
    assert sorted(console) == [2, 4, 6]
    assert "TFLOP/s/device" in caplog.text and "RSS" in caplog.text and "timers (ms/iteration" in caplog.text

    tb = read_tensorboard(tmp / "tb")
    names = set(tb)
    timers = {n for n in names if n.endswith("-time") and n != "iteration-time"}
    assert {"forward-backward-time", "optimizer-time"} <= timers
    expected = TRAIN | EVAL | timers | {"tflops-per-device", "mem-rss-bytes", "world-size"} | {f"{n} ppl" for n in EVAL}
    assert names == expected
    assert "mfu" not in names  # CPU without a configured peak: no utilization
    assert [s for s, _ in tb["lm loss"]] == [2, 4, 6]
    assert [s for s, _ in tb["lm loss validation"]] == [3, 6] and [s for s, _ in tb["lm loss test"]] == [6]
    assert math.isclose(tb["lm loss"][-1][1], console[6], rel_tol=1e-4)

    run, history = read_mlflow(f"sqlite:///{tmp}/mlflow.db", "tiny")
    assert set(history) == expected
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a" and run.data.tags["team"] == "bridge"
    assert [s for s, _ in history["lm loss"]] == [2, 4, 6] and [s for s, _ in history["lm loss validation"]] == [3, 6]
    assert math.isclose(history["lm loss"][-1][1], console[6], rel_tol=1e-4)
    assert history["lm loss"][-1][1] == pytest.approx(tb["lm loss"][-1][1], rel=1e-6)  # tb stores float32
    params = run.data.params
    assert params["train.train_iters"] == "6" and params["logger.mlflow_run_name"] == "run-a"
    assert len(params) > 300  # the whole config, over several 100-param batches
    # mlflow_log_checkpoints: the checkpoint directory is copied into the run's artifacts at its end
    from mlflow import MlflowClient

    artifacts = {f.path for f in MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db").list_artifacts(run.info.run_id, "checkpoints")}
    assert artifacts == {"checkpoints/iter_0000006", "checkpoints/latest_checkpointed_iteration.txt"}

    history, config, entity = read_wandb(cfg.logger.wandb_save_dir)  # the run went where wandb_save_dir says
    assert set(history) == expected
    assert [s for s, _ in history["lm loss"]] == [2, 4, 6]
    assert math.isclose(history["lm loss"][-1][1], console[6], rel_tol=1e-4)
    assert config["train"]["train_iters"] == 6 and entity == "bridge-team"

    metrics, params, others, experiment = read_comet(tmp / "comet")
    assert experiment["workspace"] == "bridge-workspace" and experiment["project_name"] == "tiny"
    ours = {k: v for k, v in metrics.items() if not k.startswith("sys.") and k != "process duration"}
    assert set(ours) == expected
    assert [s for s, _ in ours["lm loss"]] == [2, 4, 6]
    assert math.isclose(ours["lm loss"][-1][1], console[6], rel_tol=1e-4)
    assert params["train|train_iters"] == 6 and others["status"] == "finished" and others["Name"] == "run-a"


@pytest.mark.timeout(300)
def test_mlflow_run_is_marked_failed_when_training_raises(offline):
    needs("mlflow")
    from mlflow import MlflowClient

    def fails_at_iteration_2(state, data_iterator, model):
        if state.train_state.step == 1:
            raise RuntimeError("injected failure at iteration 2")
        return forward_step(state, data_iterator, model)

    uri = f"sqlite:///{offline}/mlflow.db"
    cfg = tiny_config(
        train=TrainingConfig(train_iters=5, global_batch_size=8, micro_batch_size=2),
        logger=LoggerConfig(log_interval=1, mlflow_experiment="tiny", mlflow_run_name="crash", mlflow_tracking_uri=uri),
    )
    with pytest.raises(RuntimeError, match="injected failure at iteration 2"):
        pretrain(cfg, fails_at_iteration_2)
    run, history = read_mlflow(uri, "tiny")
    assert run.info.status == "FAILED"
    assert [s for s, _ in history["lm loss"]] == [1]  # what was logged before the failure is kept
    assert MlflowClient(tracking_uri=uri).get_run(run.info.run_id).info.end_time is not None


@pytest.mark.timeout(300)
def test_trackers_in_the_training_process_and_metric_groups_off_by_default(offline):
    tb = offline / "tb"
    cfg = tiny_config(
        train=TrainingConfig(train_iters=6, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=3, eval_iters=1),
        logger=LoggerConfig(
            log_interval=1, tensorboard_dir=str(tb), tensorboard_log_interval=2, tracker_subprocess=False
        ),
    )
    pretrain(cfg, forward_step)
    scalars = read_tensorboard(tb)
    assert set(scalars) == TRAIN | EVAL  # no throughput, memory, timers, world size or perplexity
    assert [s for s, _ in scalars["lm loss"]] == [2, 4, 6]  # every 2nd iteration (tensorboard_log_interval)
    assert [s for s, _ in scalars["lm loss validation"]] == [3, 6]  # evaluations always


# ---------------------------------------------------------------------- errors
@pytest.mark.timeout(120)
def test_comet_online_without_api_key_fails_at_setup_with_the_fix(offline):
    needs("comet_ml")
    cfg = tiny_config(
        train=TrainingConfig(train_iters=2, global_batch_size=8, micro_batch_size=2),
        logger=LoggerConfig(comet_project="tiny", comet_experiment_name="online"),
    )
    with pytest.raises(ValueError) as err:
        pretrain(cfg, forward_step)
    assert str(err.value) == (
        "could not start the comet tracker: logger.comet_project='tiny': Comet needs an API key to log online "
        "(set logger.comet_api_key or COMET_API_KEY, or logger.comet_offline_directory to log offline)"
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "package, settings, message",
    [
        ("wandb", ["logger.wandb_project=p"],
         "mbridge pretrain: error: could not start the wandb tracker: logger.wandb_project='p': W&B refused to start: "),
        ("comet_ml", ["logger.comet_project=p", "logger.comet_experiment_name=e"],
         "mbridge pretrain: error: could not start the comet tracker: logger.comet_project='p': Comet needs an API key"),
    ],
    ids=["wandb", "comet"],
)
def test_an_online_tracker_without_credentials_stops_the_command_with_the_fix_not_a_traceback(tmp_path, package, settings, message):
    from factories import source_tree_env

    needs(package)
    env = {k: v for k, v in source_tree_env(HOME=str(tmp_path)).items() if k not in ("WANDB_API_KEY", "WANDB_MODE", "COMET_API_KEY")}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bridge", "pretrain", "--recipe", "tiny_gpt_pretrain_config", "train.train_iters=2",
         "--dir", str(tmp_path / "runs"), "dist.distributed_backend=gloo", *settings],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert message in proc.stderr
    assert "to log offline)" in proc.stderr


@pytest.mark.parametrize(
    "module, cls, kwargs, extra",
    [
        ("tensorboard", "TensorBoardTracker", {"log_dir": "tb"}, "tensorboard"),
        ("wandb_tracker", "WandbTracker", {"project": "p"}, "wandb"),
        ("mlflow_tracker", "MlflowTracker", {"experiment": "e", "run_name": "r"}, "mlflow"),
        ("comet_tracker", "CometTracker", {"project": "p", "experiment_name": "e"}, "comet"),
    ],
)
def test_missing_backend_package_names_the_extra(monkeypatch, module, cls, kwargs, extra):
    import importlib

    package = {"comet": "comet_ml"}.get(extra, extra)
    monkeypatch.setitem(sys.modules, package, None)  # as if it were not installed
    tracker = getattr(importlib.import_module(f"megatron_bridge.training.loggers.{module}"), cls)
    with pytest.raises(ModuleNotFoundError, match=re.escape(f"pip install 'megatron-bridge[{extra}]'")):
        tracker(**kwargs)


def test_mlflow_params_respect_the_length_and_key_limits():
    needs("mlflow")
    from mlflow.utils import validation

    from megatron_bridge.training.loggers import mlflow_tracker as mt

    assert (mt.MAX_PARAM_VALUE_LENGTH, mt.MAX_PARAMS_PER_BATCH, mt.MAX_METRICS_PER_BATCH, mt.MAX_KEY_LENGTH) == (
        validation.MAX_PARAM_VAL_LENGTH,
        validation.MAX_PARAMS_TAGS_PER_BATCH,
        validation.MAX_METRICS_PER_BATCH,
        validation.MAX_ENTITY_KEY_LENGTH,
    )
    params = dict(
        mt.config_params({"a": {"long": "x" * 7000, "none": None, "list": [1, 2]}, "env_vars": {"odd=key": 1}})
    )
    assert len(params["a.long"]) == 6000 and params["a.long"].endswith("...[truncated]")
    assert params["a.none"] == "None" and params["a.list"] == "[1, 2]" and params["env_vars.odd_key"] == "1"


@pytest.mark.timeout(120)
def test_mlflow_logs_checkpoints_as_artifacts_when_asked(offline):
    needs("mlflow")
    from mlflow import MlflowClient

    from megatron_bridge.training.loggers.mlflow_tracker import MlflowTracker

    ckpt = offline / "ckpt" / "iter_0000002"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text("{}")
    uri = f"sqlite:///{offline}/mlflow.db"
    tracker = MlflowTracker("tiny", "with-ckpt", tracking_uri=uri, checkpoint_dir=str(offline / "ckpt"))
    tracker.log_many([Record(1, {"lm loss": 2.0}, 0.0), Record(2, {"lm loss": 1.5}, 0.0)])
    tracker.close()
    client = MlflowClient(tracking_uri=uri)
    paths = [f.path for f in client.list_artifacts(tracker.run_id, "checkpoints/iter_0000002")]
    assert paths == ["checkpoints/iter_0000002/metadata.json"]
    assert [m.value for m in client.get_metric_history(tracker.run_id, "lm loss")] == [2.0, 1.5]


# ---------------------------------------------------------------------- the tracker process
@pytest.mark.timeout(120)
def test_tracker_process_that_dies_does_not_stop_training(tmp_path, caplog):
    from megatron_bridge.training.loggers.process import TrackerProcess

    spec = TrackerSpec(
        "tensorboard", "megatron_bridge.training.loggers.tensorboard", "TensorBoardTracker", {"log_dir": str(tmp_path)}
    )
    tracker = TrackerProcess([spec])
    tracker.log_config({"a": 1})  # waits until it started
    tracker.log_metrics({"lm loss": 1.0}, 1)
    tracker.proc.kill()
    tracker.proc.wait()
    with caplog.at_level("WARNING", logger="megatron_bridge"):
        for step in range(2, 200):  # until the pipe reports the reader gone
            tracker.log_metrics({"lm loss": 1.0}, step)
    assert "the experiment tracker process exited (code -9): metrics are no longer recorded" in caplog.text
    with pytest.raises(RuntimeError, match="the experiment tracker process exited with code -9 before it could finish"):
        tracker.close()


@pytest.mark.timeout(120)
def test_tracker_process_reports_a_backend_that_could_not_start(tmp_path):
    needs("mlflow")
    from megatron_bridge.training.loggers.process import TrackerProcess

    spec = TrackerSpec(
        "mlflow",
        "megatron_bridge.training.loggers.mlflow_tracker",
        "MlflowTracker",
        {"experiment": "e", "run_name": "r", "tracking_uri": "nosuchscheme://x"},
    )
    tracker = TrackerProcess([spec])
    # MLflow's exception types are not built-ins: a RuntimeError carries the type name and message
    with pytest.raises(RuntimeError, match=r"^\w+Exception: could not start the mlflow tracker: .*'nosuchscheme://x'"):
        tracker.log_config({})
    tracker.close()  # after a failed start: returns, does not hang


# ---------------------------------------------------------------------- the metrics themselves
@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA B200", 2250.0),
        ("Some Future GPU", None),
    ],
)
def test_peak_tflops_by_gpu_name(name, peak):
    from megatron_bridge.runtime.gpu_peaks import peak_tflops_for

    assert peak_tflops_for(name) == peak


def test_tflops_per_device_from_the_model_shape_and_mfu_with_a_configured_peak():
    from megatron_bridge.models.param_count import flops_per_token
    from megatron_bridge.training import console
    from megatron_bridge.training.metrics import throughput

    cfg = tiny_config()
    cfg.model.vocab_size = 256
    out = throughput(cfg, step_time=0.5, global_batch=8, world_size=2, device="cpu")
    expected = flops_per_token(cfg.model, 32, 256) * 32 * 8 / 0.5 / 2 / 1e12
    assert out == {"tflops-per-device": pytest.approx(expected)}  # no peak known on CPU: no MFU
    cfg.logger.peak_tflops_per_device = expected * 4
    out = throughput(cfg, step_time=0.5, global_batch=8, world_size=2, device="cpu")
    assert out["mfu"] == pytest.approx(0.25)
    line = console.train_line(
        5, 10, {"consumed-samples": 40, "iteration-time": 0.5, "tokens-per-second": 512, "learning-rate": 1e-3,
                "batch-size": 8, "lm loss": 3.0, "mem-rss-bytes": 2**30, **out}, 3.0,
    )  # fmt: skip
    assert "TFLOP/s/device | MFU 25.0% | RSS 1.00 GiB" in line


class _Recording:
    """A tracker that keeps the batches it is handed."""

    def __init__(self):
        self.batches = []

    def log_many(self, records):
        self.batches.append(list(records))

    def close(self, failed=False):
        pass


def _serve_records(records, monkeypatch):
    """Run the tracker process's loop in this process over `records` then a close; the batches."""
    import threading
    from multiprocessing import Pipe

    from megatron_bridge.training.loggers import worker

    monkeypatch.setattr(worker, "FLUSH_SECONDS", 0.01)
    to_worker, inbox = Pipe()
    outbox, replies = Pipe()
    recording = _Recording()

    def feed():  # from a thread: the pipe holds far fewer records than are sent
        for record in records:
            to_worker.send(("metrics", record))
        to_worker.send(("close", False))

    feeder = threading.Thread(target=feed)
    feeder.start()
    worker.serve(inbox, outbox, worker._Hosted([("recording", recording)]))
    feeder.join()
    assert replies.recv() == ("closed", [])
    return recording.batches


@pytest.mark.timeout(60)
def test_tracker_process_hands_over_bounded_batches_and_keeps_order(monkeypatch):
    from megatron_bridge.training.loggers import worker

    monkeypatch.setattr(worker, "MAX_BATCH", 100)
    records = [Record(step, {"lm loss": float(step)}, time.time()) for step in range(1050)]
    batches = _serve_records(records, monkeypatch)
    assert max(len(b) for b in batches) == 100  # a backlog stays in the pipe, not in memory
    assert [r.step for b in batches for r in b] == list(range(1050))


@pytest.mark.timeout(60)
def test_tracker_process_warns_once_when_far_behind_training(monkeypatch, capsys):
    old = time.time() - 600
    batches = _serve_records([Record(step, {"lm loss": 1.0}, old) for step in range(3)], monkeypatch)
    assert sum(len(b) for b in batches) == 3
    err = capsys.readouterr().err
    assert err.count("experiment trackers are") == 1
    assert re.search(r"are 6\d\d s behind training: .* leave a core free \(OMP_NUM_THREADS\)", err)


def test_tracker_settings_without_their_tracker_are_named(caplog):
    import logging

    from megatron_bridge.training.loggers.base import NullTracker
    from megatron_bridge.training.loggers.factory import build_tracker

    cfg = tiny_config(logger=LoggerConfig(wandb_exp_name="run-a", wandb_entity="team", mlflow_tags={"a": "b"}))
    with caplog.at_level(logging.WARNING, logger="megatron_bridge"):
        assert isinstance(build_tracker(cfg, is_logging_rank=True), NullTracker)  # nothing is turned on
    assert [r.getMessage() for r in caplog.records] == [
        "logger.wandb_exp_name, logger.wandb_entity set, but logger.wandb_project is not: no W&B logging "
        "(set logger.wandb_project to turn it on)",
        "logger.mlflow_tags set, but logger.mlflow_experiment is not: no MLflow logging "
        "(set logger.mlflow_experiment to turn it on)",
    ]


@pytest.mark.timeout(120)
def test_tracker_process_whose_trainer_is_gone_before_it_started_exits_quietly(tmp_path):
    """A training process stopped by a signal while its trackers start: the tracker process
    finds no one to tell that it is ready, and exits without a traceback on the user's terminal."""
    from megatron_bridge.training.loggers.process import _child_env

    spec = TrackerSpec(
        "tensorboard", "megatron_bridge.training.loggers.tensorboard", "TensorBoardTracker", {"log_dir": str(tmp_path)}
    )
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    os.close(from_child_r)  # the trainer is gone before the tracker process can answer
    child = subprocess.Popen(
        [sys.executable, "-m", "megatron_bridge.training.loggers.worker", str(to_child_r), str(from_child_w)],
        pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=_child_env(),
    )  # fmt: skip
    os.close(to_child_r)
    os.close(from_child_w)
    with Connection(to_child_w, readable=False) as to_child:
        to_child.send(("specs", [spec]))
    _, stderr = child.communicate(timeout=100)
    assert "Traceback" not in stderr, stderr
    assert child.returncode == 0
