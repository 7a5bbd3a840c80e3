"""`mbridge plot`: curves from TensorBoard event files (of a real training run) and from MLflow."""

import os
import subprocess
import sys

import pytest
from factories import needs, source_tree_env, tiny_config

from megatron_bridge.cli.main import main
from megatron_bridge.cli.plot import short_labels
from megatron_bridge.training.config import LoggerConfig, TrainingConfig, ValidationConfig
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.loggers.base import Record
from megatron_bridge.training.loggers.readback import read_tensorboard
from megatron_bridge.training.loggers.tensorboard import TensorBoardTracker
from megatron_bridge.training.pretrain import pretrain


def image(path):
    from matplotlib.image import imread

    pixels = imread(str(path))
    return pixels.shape[:2], float(pixels[..., :3].std())


def synthetic_records(steps, offset=0.0):
    return [
        Record(
            s,
            {
                "lm loss": 5.0 - 0.3 * s + offset,
                "learning-rate": 1e-3 * s,
                "tokens-per-second": 1000.0 + s,
                "iteration-time": 0.1,
            },
            0.0,
        )
        for s in steps
    ]


@pytest.mark.timeout(300)
def test_two_runs_side_by_side_from_event_files(tmp_path, capsys):
    from megatron_bridge.plotting import plot_runs

    trained = tmp_path / "trained"
    cfg = tiny_config(
        train=TrainingConfig(train_iters=8, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=4, eval_iters=1),
        logger=LoggerConfig(log_interval=1, tensorboard_dir=str(trained / "tb"), tracker_subprocess=False),
    )
    pretrain(cfg, forward_step)
    other = tmp_path / "other" / "nested" / "tb"  # found recursively under other/
    tracker = TensorBoardTracker(str(other))
    tracker.log_many(synthetic_records(range(1, 9)))
    tracker.log_metrics({"lm loss validation": 3.0}, 8)
    tracker.close()

    out = tmp_path / "curves.png"
    assert main(["plot", str(trained), str(tmp_path / "other"), "-o", str(out), "--size", "900x300"]) == 0
    assert "loss: 4 lines, learning rate: 2 lines, throughput (tokens/s): 2 lines" in capsys.readouterr().out
    assert short_labels([str(trained), str(tmp_path / "other")]) == ["trained", "other"]
    assert short_labels(["runs/a/tb", "runs/b/tb"]) == ["a/tb", "b/tb"]
    shape, spread = image(out)
    assert shape == (300, 900) and spread > 0.01  # the requested size, not a blank canvas

    runs = [read_tensorboard(str(trained), "trained"), read_tensorboard(str(tmp_path / "other"), "other")]
    drawn = plot_runs(runs, str(tmp_path / "again.png"))
    lines = [(d.run, d.metric) for d in drawn["loss"]]
    assert lines == [(run, metric) for run in ("trained", "other") for metric in ("lm loss", "lm loss validation")]
    train_loss = drawn["loss"][0].series
    assert train_loss.steps == list(range(1, 9)) and train_loss.values[-1] < train_loss.values[0]
    assert drawn["loss"][1].series.steps == [4, 8]  # validation at eval_interval and at the end
    assert drawn["learning rate"][1].series.values == pytest.approx([1e-3 * s for s in range(1, 9)])
    assert [d.metric for d in drawn["throughput (tokens/s)"]] == ["tokens-per-second"] * 2
    assert image(tmp_path / "again.png")[0] == (450, 1500)  # the default size


@pytest.mark.timeout(120)
def test_mlflow_runs_by_name(tmp_path, monkeypatch):
    needs("mlflow")
    from megatron_bridge.training.loggers.mlflow_tracker import MlflowTracker

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    for name, offset in (("run-a", 0.0), ("run-b", 0.5)):
        tracker = MlflowTracker("tiny", name, tracking_uri=uri)
        tracker.log_many(synthetic_records(range(1, 6), offset))
        tracker.close()
    out = tmp_path / "mlflow.png"
    assert main(["plot", "--mlflow-uri", uri, "--run", "run-a", "--run", "run-b", "-o", str(out)]) == 0
    shape, spread = image(out)
    assert shape == (450, 1500) and spread > 0.01
    assert main(["plot", "--mlflow-uri", uri, "--run", "nope", "-o", str(out)]) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plot"], "nothing to plot: give RUN_DIR(s) with TensorBoard event files, or --mlflow-uri URI --run NAME"),
        (
            ["plot", "--run", "a"],
            "--run needs --mlflow-uri (e.g. sqlite:///mlflow.db, or the path of an mlruns directory)",
        ),
        (["plot", "{tmp}/missing"], "{tmp}/missing: no such directory"),
        (["plot", "{tmp}"], "{tmp}: no TensorBoard event files (events.out.tfevents.*) under it"),
        (
            ["plot", "{tmp}", "--size", "big"],
            "--size 'big': expected WIDTHxHEIGHT in pixels, each at least 100 (e.g. 1500x450)",
        ),
        (
            ["plot", "--mlflow-uri", "sqlite:///{tmp}/m.db", "--run", "nope"],
            "no MLflow run named 'nope' at sqlite:///{tmp}/m.db",
        ),
    ],
)
def test_plot_usage_errors(tmp_path, monkeypatch, capsys, argv, message):
    if "--mlflow-uri" in argv:
        needs("mlflow")  # without it, the error is that MLflow is missing
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # after MLflow's own log lines
    assert last_line == "mbridge plot: error: " + message.format(tmp=tmp_path)


def test_a_run_without_the_plotted_metrics_is_named(tmp_path, capsys):
    tracker = TensorBoardTracker(str(tmp_path / "odd"))
    tracker.log_metrics({"something-else": 1.0}, 1)
    tracker.close()
    assert main(["plot", str(tmp_path / "odd"), "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip() == (
        "mbridge plot: error: run 'odd' has none of the plotted metrics "
        "(lm loss, lm loss validation, learning-rate, tokens-per-second); it has: something-else"
    )


@pytest.mark.timeout(120)
def test_an_output_that_is_a_directory_is_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "megatron_bridge", "plot", str(tmp_path), "-o", str(tmp_path)],
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"--output {str(tmp_path)!r} is a directory; give the image file to write, e.g. {tmp_path}/training_curves.png" in done.stderr
    assert not os.path.exists(f"{tmp_path}.png")


@pytest.mark.timeout(120)
def test_an_output_in_a_missing_directory_is_refused_before_reading_the_runs(tmp_path):
    output = str(tmp_path / "plots" / "loss.png")
    done = subprocess.run([sys.executable, "-m", "megatron_bridge", "plot", str(tmp_path / "no_run"), "-o", output],
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (
        f"mbridge plot: error: --output {output!r}: its directory {str(tmp_path / 'plots')!r} does not exist "
        "(create it, or write the image elsewhere)"
    )


@pytest.mark.timeout(120)
def test_reading_a_missing_mlflow_store_creates_nothing(tmp_path):
    """A tracking URI naming no store: MLflow created the database (and its directory) that the
    plot was to read from."""
    needs("mlflow")
    for uri, made in ((f"sqlite:///{tmp_path}/new/m.db", tmp_path / "new"), (f"sqlite:///{tmp_path}/m.db", tmp_path / "m.db")):
        done = subprocess.run([sys.executable, "-m", "megatron_bridge", "plot", "--mlflow-uri", uri, "--run", "a", "-o", str(tmp_path / "x.png")],
                              capture_output=True, text=True, timeout=100, env=source_tree_env(MLFLOW_DISABLE_TELEMETRY="true"))  # fmt: skip
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert done.stderr.strip().splitlines()[-1] == f"mbridge plot: error: no MLflow run named 'a' at {uri}"
        assert not made.exists()


@pytest.mark.timeout(120)
def test_an_mlruns_directory_given_as_a_file_uri_is_read_like_its_path(tmp_path):
    """`--mlflow-uri file:///.../mlruns` ended in MLflow 3's refusal of file stores (a traceback);
    the directory's plain path was read."""
    needs("mlflow")
    (tmp_path / "mlruns").mkdir()
    uri = f"file://{tmp_path}/mlruns"
    env = {k: v for k, v in source_tree_env(MLFLOW_DISABLE_TELEMETRY="true").items() if k != "MLFLOW_ALLOW_FILE_STORE"}
    done = subprocess.run([sys.executable, "-m", "megatron_bridge", "plot", "--mlflow-uri", uri, "--run", "a", "-o", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=100, env=env)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == f"mbridge plot: error: no MLflow run named 'a' at {uri}"
