"""Checkpoints on disk: exact resume, crash safety, retention, signals, resharding, finetune()."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from factories import on_cpu, tiny_config, tiny_model

from megatron_bridge.training.callbacks import Callback
from megatron_bridge.training.checkpointing import CheckpointMismatchError, read_tracker
from megatron_bridge.runtime.checkpointing.layout import complete_iterations, resolve, write_tracker
from megatron_bridge.training.config import (
    CheckpointConfig,
    ConfigValidationError,
    FinetuningDatasetConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron_bridge.training.finetune import finetune
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain

SCRIPT = Path(__file__).parent / "scripts" / "train_tiny.py"
pytestmark = pytest.mark.timeout(400)


class Losses(Callback):
    def __init__(self):
        self.values = []

    def on_step_end(self, state, metrics):
        self.values.append(metrics["lm loss"])


def config(save=None, load=None, iters=20, **ckpt):
    cfg = tiny_config(
        train=TrainingConfig(train_iters=iters, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
        checkpoint=CheckpointConfig(save=save, load=load, **ckpt),
    )
    assert cfg.model.hidden_dropout == 0.1  # dropout on: resuming must restore the RNG streams
    return cfg


def run(cfg, step=forward_step):
    losses = Losses()
    state = pretrain(cfg, step, callbacks=[losses])
    return losses.values, state


def test_resume_continues_exactly(tmp_path, caplog):
    # Bit for bit on CPU, on every machine: some CUDA kernels reduce in a varying order (a GPU
    # checkpoint resumes within a tolerance: tests/test_gpu.py).
    straight, _ = run(on_cpu(config()))
    ckpt = str(tmp_path / "ckpt")
    first_cfg = on_cpu(config(save=ckpt))
    first_cfg.train.exit_interval = 10
    first, state = run(first_cfg)
    assert state.train_state.step == 10 and read_tracker(ckpt) == 10
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        second, state = run(on_cpu(config(save=ckpt, load=ckpt)))
    assert "resumed from iteration 10" in caplog.text
    assert "RNG states not restored" not in caplog.text  # same layout: restored
    assert state.train_state.step == 20 and state.train_state.consumed_train_samples == 160
    assert first + second == straight  # identical at every iteration
    assert read_tracker(ckpt) == 20


def test_checkpoint_layout_and_run_config(tmp_path):
    ckpt = tmp_path / "ckpt"
    run(config(save=str(ckpt), iters=4, save_interval=2))
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    files = {p.name for p in (ckpt / "iter_0000004").iterdir()}
    assert {"run_config.yaml", "common.pt", "metadata.json"} <= files and any(f.endswith(".distcp") for f in files)
    from megatron_bridge.training.config import ConfigContainer

    saved = ConfigContainer.from_yaml(ckpt / "iter_0000004" / "run_config.yaml")
    assert saved.model.num_layers == 2 and saved.train.train_iters == 4 and saved.data_parallel_size == 1


def test_retention_keeps_exactly_most_recent_k(tmp_path):
    ckpt = tmp_path / "ckpt"
    run(config(save=str(ckpt), iters=10, save_interval=2, most_recent_k=2))
    assert complete_iterations(str(ckpt)) == [8, 10] and read_tracker(str(ckpt)) == 10


def _kill_session(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _script(*args, env=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return [sys.executable, str(SCRIPT), *args], env


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_latest(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd, env = _script("--iters", "200", "--save", str(ckpt), "--save-interval", "2", "--out", str(tmp_path / "o"))
    # its own session: the kill must also reach the helper processes checkpointing starts
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    killed_during = None
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            staging = [p.name for p in ckpt.glob("iter_*.incomplete")] if ckpt.is_dir() else []
            if staging and read_tracker(str(ckpt)) is not None:
                proc.send_signal(signal.SIGKILL)
                killed_during = int(staging[0][len("iter_") : -len(".incomplete")])
                break
            time.sleep(0.005)
    finally:
        _kill_session(proc)
    assert killed_during is not None, "never caught a save in progress"
    latest = read_tracker(str(ckpt))
    assert latest < killed_during
    assert (ckpt / f"iter_{latest:07d}" / "common.pt").is_file()
    # the latest checkpoint loads and training continues from it
    resume = config(save=str(ckpt), load=str(ckpt), iters=latest + 2)
    resume.scheduler.override_opt_param_scheduler = True  # a shorter plan than the killed run's
    losses, state = run(resume)
    assert state.train_state.step == latest + 2 and len(losses) == 2


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "o"
    cmd, env = _script(
        "--iters", "500", "--save", str(ckpt), "--exit-signal-handler", "--step-sleep", "0.05", "--out", str(out)
    )  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if " 3/500 |" in line:
            proc.send_signal(signal.SIGTERM)
            break
    try:
        rest, _ = proc.communicate(timeout=240)
    finally:
        _kill_session(proc)  # nothing of the job may outlive the test
    output = "".join(lines) + rest
    assert proc.returncode == 0, output[-3000:]
    assert "training stopped at iteration" in output and "exit signal received" in output
    step = json.loads(Path(f"{out}.rank0").read_text())["step"]
    assert 3 <= step < 500 and read_tracker(str(ckpt)) == step


def test_loading_a_different_architecture_lists_the_differences(tmp_path):
    from megatron_bridge.training.checkpointing.compat import check_architecture

    ckpt = str(tmp_path / "ckpt")
    run(config(save=ckpt, iters=2))
    other = config(load=ckpt, iters=4)
    other.model = tiny_model(hidden_size=96, ffn_hidden_size=128)
    with pytest.raises(ConfigValidationError) as err:
        pretrain(other, forward_step)  # refused at validation: no process group, no model
    assert err.value.errors == [
        f"checkpoint.load: {ckpt!r} holds a GPTModelProvider (2 layers, hidden size 64, 4 attention heads), but the "
        "config's model is a GPTModelProvider (2 layers, hidden size 96, 4 attention heads) (hidden_size: checkpoint "
        "64, config 96; kv_channels: checkpoint 16, config 24; ffn_hidden_size: checkpoint 256, config 128) (point it "
        "at a checkpoint of this architecture, or use the checkpoint's model (e.g. the matching recipe))"
    ]
    assert not torch.distributed.is_initialized()
    # loading checks again, with the values derived since (the vocabulary size from the tokenizer)
    with pytest.raises(CheckpointMismatchError) as err:
        check_architecture(os.path.join(ckpt, "iter_0000002"), other.model)
    assert "model.hidden_size: checkpoint 64, config 96" in str(err.value)
    assert "model.ffn_hidden_size: checkpoint 256, config 128" in str(err.value)


def test_checkpoints_and_hugging_face_weights_are_compared_on_one_list_of_fields():
    """The fields that shape the weights are one list: a saved run's checkpoint compared only a
    subset of them (not the latent-attention sizes or the MoE layer pattern)."""
    from megatron_bridge.models.hf.config import WEIGHT_SHAPE_FIELDS
    from megatron_bridge.models.saved_architecture import ARCHITECTURE_FIELDS, differing_fields

    assert ARCHITECTURE_FIELDS == (*WEIGHT_SHAPE_FIELDS, "activation_func")
    saved = {"num_layers": 2, "multi_latent_attention": True, "q_lora_rank": 64, "kv_lora_rank": 32, "moe_layer_freq": 1}
    config = {**saved, "q_lora_rank": 96, "moe_layer_freq": [0, 1]}
    assert differing_fields(saved, config, "checkpoint", "config") == (
        "q_lora_rank: checkpoint 64, config 96; moe_layer_freq: checkpoint 1, config [0, 1]"
    )


@pytest.mark.slow
def test_ckpt_step_and_iteration_directory(tmp_path):
    ckpt = tmp_path / "ckpt"
    run(config(save=str(ckpt), iters=4, save_interval=2))
    longer = config(load=str(ckpt), iters=6, ckpt_step=2)
    longer.scheduler.override_opt_param_scheduler = True
    _, state = run(longer)
    assert state.train_state.step == 6 and state.train_state.consumed_train_samples == 48
    _, state = run(config(pretrained_checkpoint=str(ckpt / "iter_0000002"), iters=3))
    assert state.train_state.step == 3  # weights only: the step count starts at 0
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for ckpt_step=3 .*complete iterations: \[2, 4\]"):
        pretrain(config(load=str(ckpt), iters=6, ckpt_step=3), forward_step)
    # the command line: refused before anything is built, naming the field (exit 2, no traceback)
    for extra in ([], ["--dry-run"]):
        out = subprocess.run(
            [sys.executable, "-m", "megatron_bridge", "pretrain", "--recipe", "tiny_gpt_pretrain_config", "--dir",
             str(tmp_path / "runs"), f"checkpoint.load={ckpt}", "checkpoint.ckpt_step=3", *extra],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == (0 if extra else 2), out.stderr[-2000:]
        expected = f"checkpoint.ckpt_step: no checkpoint for ckpt_step=3 in '{ckpt}' (complete iterations: [2, 4])"
        assert expected in out.stdout + out.stderr and "Traceback" not in out.stderr


def test_extending_a_finished_run_is_decided_at_validation(tmp_path, caplog):
    from megatron_bridge.training.config import runtime_config_update

    ckpt = str(tmp_path / "ckpt")
    run(config(save=ckpt, iters=4))
    refused = config(load=ckpt, iters=8)
    refused.scheduler.override_opt_param_scheduler = False  # explicitly: keep the checkpoint's check
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(refused)  # before anything is built
    (message,) = err.value.errors
    assert message.startswith("scheduler.override_opt_param_scheduler: False, but the schedule differs")
    assert "train.train_iters 4 -> 8" in message and "use_checkpoint_opt_param_scheduler=True" in message
    longer = config(load=ckpt, iters=8)
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        runtime_config_update(longer)
    assert longer.scheduler.override_opt_param_scheduler is True
    assert "the schedule follows this config" in caplog.text and "train.train_iters 4 -> 8" in caplog.text
    _, state = run(longer)
    assert state.train_state.step == 8


class RecordingManager:
    """A custom checkpoint manager: keeps the model weights in memory."""

    calls = []

    def __init__(self, config):
        self.config = config

    def save(self, run, reason):
        RecordingManager.calls.append(("save", run.state.train_state.step, reason))

    def load(self, run):
        RecordingManager.calls.append(("load",))
        return None

    def finalize_async_saves(self, blocking=False):
        RecordingManager.calls.append(("finalize", blocking))


def test_custom_manager_class_replaces_the_default(tmp_path):
    from megatron_bridge.config.targets import register_target

    register_target(RecordingManager)
    RecordingManager.calls = []
    cfg = config(save=str(tmp_path / "ckpt"), iters=4, save_interval=2, custom_manager_class="test_checkpoints.RecordingManager")
    run(cfg)
    assert RecordingManager.calls == [("load",), ("save", 2, "interval"), ("save", 4, "interval"), ("save", 4, "end of training"), ("finalize", True)]
    assert list((tmp_path / "ckpt").iterdir()) == []  # the default manager wrote nothing


def test_custom_manager_class_outside_the_allowlist_is_refused(tmp_path):
    cfg = config(save=str(tmp_path / "ckpt"), iters=2, custom_manager_class="os.system")
    with pytest.raises(ConfigValidationError, match="checkpoint.custom_manager_class: 'os.system' is not a name configs may use"):
        pretrain(cfg, forward_step)
    assert not (tmp_path / "ckpt").exists()


def test_async_save_on_cpu_uses_a_worker_per_save(tmp_path, caplog):
    ckpt = tmp_path / "ckpt"
    with caplog.at_level("INFO", logger="megatron_bridge"):
        losses, _ = run(on_cpu(config(save=str(ckpt), iters=6, save_interval=3, async_save=True)))
    assert "checkpoint.use_persistent_ckpt_worker=False (the persistent worker needs CUDA)" in caplog.text
    assert complete_iterations(str(ckpt)) == [3, 6] and read_tracker(str(ckpt)) == 6
    resumed, state = run(on_cpu(config(load=str(ckpt), iters=6)))
    assert state.train_state.step == 6 and resumed == []
    explicit = on_cpu(config(save=str(ckpt), iters=6, async_save=True, use_persistent_ckpt_worker=True))
    with pytest.raises(ConfigValidationError, match="the persistent async checkpoint worker needs CUDA"):
        pretrain(explicit, forward_step)


def test_finetune_needs_pretrained_weights():
    with pytest.raises(ConfigValidationError) as err:
        finetune(config(), forward_step)
    assert err.value.errors == [
        "checkpoint.pretrained_checkpoint: finetune() needs pretrained weights, and neither pretrained_checkpoint "
        "nor a resumable load is set (set checkpoint.pretrained_checkpoint to a checkpoint directory (or use pretrain()))"
    ]


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def test_pretrain_then_finetune_on_jsonl_with_the_loss_on_answers(tmp_path):
    from megatron_bridge.data.finetuning import PromptAnswerDataset, read_examples
    from megatron_bridge.runtime.tokenizers.tokenizer import NullTokenizer

    ckpt = str(tmp_path / "pretrained")
    run(config(save=ckpt, iters=10))
    # prompts are random (unlearnable); answers count up from the prompt's last token
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(64):
        prompt = torch.randint(0, 255, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen).tolist()
        answer = [(prompt[-1] + 1 + i) % 255 for i in range(int(torch.randint(2, 8, (1,), generator=gen)))]
        rows.append({"input": " ".join(map(str, prompt)), "output": " ".join(map(str, answer))})
    data = tmp_path / "sft"
    data.mkdir()
    _write_jsonl(data / "training.jsonl", rows)
    _write_jsonl(data / "validation.jsonl", rows[:8])

    sample = PromptAnswerDataset([([5, 6, 7], [8, 9])], NullTokenizer(256), 32, 1, 0)[0]
    assert sample == {"tokens": [5, 6, 7, 8, 9], "labels": [6, 7, 8, 9, 255], "loss_mask": [0, 0, 1, 1, 1]}

    cfg = tiny_config(
        train=TrainingConfig(train_iters=40, global_batch_size=8, micro_batch_size=2),
        dataset=FinetuningDatasetConfig(dataset_root=str(data), seq_length=32, num_workers=0, max_train_samples=48),
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
        checkpoint=CheckpointConfig(pretrained_checkpoint=ckpt, save=str(tmp_path / "sft_ckpt")),
    )
    losses = Losses()
    state = finetune(cfg, forward_step, callbacks=[losses])
    assert state.train_state.step == 40 and read_tracker(str(tmp_path / "sft_ckpt")) == 40
    print("finetune losses", [round(x, 2) for x in losses.values])
    # only answer tokens count, and they follow a learnable rule (the prompts are noise)
    assert sum(losses.values[-5:]) / 5 < sum(losses.values[:5]) / 5 - 1.0
    assert len(read_examples(str(data / "training.jsonl"), "input", "output", 48)) == 48


def test_writer_results_come_back_without_a_helper_process(tmp_path, monkeypatch):
    """The checkpoint writer's results: straight from this process, and over a pipe from a forked
    background writer, however large and even after that writer has exited; no manager process
    is started for them (it cost seconds on a job's first save)."""
    import multiprocessing as mp
    import queue

    import psutil

    from megatron_bridge.runtime.checkpointing import results_queue

    results = results_queue.ForkedResultsQueue()
    results.put({"rank": 0})
    assert results.get_nowait() == {"rank": 0}
    large = {"items": list(range(200_000))}  # megabytes: more than a pipe holds
    writer = mp.get_context("fork").Process(target=results.put, args=(large,))
    writer.start()
    writer.join(timeout=60)
    assert writer.exitcode == 0
    assert results.get_nowait() == large
    monkeypatch.setattr(results_queue, "RESULT_WAIT_SECONDS", 0.1)
    with pytest.raises(queue.Empty):
        results.get_nowait()

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    run(config(save=str(tmp_path / "ckpt"), iters=2))
    started = [p.cmdline() for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not [c for c in started if "spawn_main" in " ".join(c)], started
    assert read_tracker(str(tmp_path / "ckpt")) == 2


def test_a_directory_without_a_checkpoint_says_where_one_is(tmp_path):
    """`resolve` of a directory holding no checkpoint names the one meant: a run directory's
    `checkpoints/`, the newest iteration of a directory without its tracker, or a save that did
    not finish."""
    (tmp_path / "run" / "checkpoints" / "iter_0000002").mkdir(parents=True)
    write_tracker(str(tmp_path / "run" / "checkpoints"), 2)
    (tmp_path / "untracked" / "iter_0000004").mkdir(parents=True)
    (tmp_path / "untracked" / "iter_0000002").mkdir()
    (tmp_path / "unfinished" / "iter_0000006.incomplete").mkdir(parents=True)
    expected = {
        "run": f"did you mean {str(tmp_path / 'run' / 'checkpoints')!r}? (it holds one)",
        "untracked": f"give one of its iterations, e.g. {str(tmp_path / 'untracked' / 'iter_0000004')!r}",
        "unfinished": "its only save did not finish (a run still saving, or one stopped while saving)",
    }
    for name, hint in expected.items():
        path = str(tmp_path / name)
        with pytest.raises(FileNotFoundError) as err:
            resolve(path)
        assert str(err.value) == f"no checkpoint in {path!r}: no latest_checkpointed_iteration.txt and not an iter_* directory; {hint}"
    assert resolve(str(tmp_path / "run" / "checkpoints")) == (str(tmp_path / "run" / "checkpoints" / "iter_0000002"), 2)
    missing = str(tmp_path / "no-such-run" / "checkpoints")
    with pytest.raises(FileNotFoundError, match="it does not exist"):
        resolve(missing)


class Evaluations(Callback):
    def __init__(self):
        self.at = []

    def on_eval_end(self, state, *args, **kwargs):
        self.at.append(state.train_state.step)


def test_resuming_with_fewer_evaluations_or_a_smaller_batch_still_has_data(tmp_path):
    """A fine-tuning set is sized for the run's samples; a job resumed with a config that needs
    fewer (eval_interval raised, global batch lowered, a finished run evaluated again) than the
    earlier jobs drew must still find data after the consumed counts."""
    rows = [{"input": f"{i} {i + 1} {i + 2}", "output": f"{i + 3} {i + 4}"} for i in range(12)]
    data = tmp_path / "sft"
    data.mkdir()
    _write_jsonl(data / "training.jsonl", rows)
    _write_jsonl(data / "validation.jsonl", rows[:4])
    save = str(tmp_path / "ckpt")

    def sft(iters, gbs, eval_interval):
        return tiny_config(
            train=TrainingConfig(train_iters=iters, global_batch_size=gbs, micro_batch_size=2),
            dataset=FinetuningDatasetConfig(dataset_root=str(data), seq_length=32, num_workers=0),
            validation=ValidationConfig(eval_interval=eval_interval, eval_iters=1),
            checkpoint=CheckpointConfig(save=save, load=save),
        )

    _, state = run(sft(iters=4, gbs=8, eval_interval=2))
    assert (state.train_state.consumed_train_samples, state.train_state.consumed_valid_samples) == (32, 16)
    evaluations = Evaluations()
    state = pretrain(sft(iters=6, gbs=4, eval_interval=None), forward_step, callbacks=[evaluations])
    assert state.train_state.step == 6 and state.train_state.consumed_train_samples == 40
    assert evaluations.at == [6]  # the validation at the end
    again = Evaluations()
    state = pretrain(sft(iters=6, gbs=4, eval_interval=None), forward_step, callbacks=[again])
    assert state.train_state.step == 6 and again.at == [6]  # finished: evaluated again


def test_resuming_with_another_tokenizer_is_warned_about(tmp_path, caplog):
    from text_data import documents, train_tokenizer

    from megatron_bridge.training.config import runtime_config_update
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    trained_with = train_tokenizer(str(tmp_path / "tok"))
    other = train_tokenizer(str(tmp_path / "other"), texts=[d.upper() for d in documents(400, seed=7)])
    ckpt = str(tmp_path / "ckpt")

    def with_tokenizer(directory, iters):
        cfg = config(save=ckpt, load=ckpt, iters=iters)
        cfg.tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=directory)
        return cfg

    run(with_tokenizer(trained_with, iters=1))
    with caplog.at_level(logging.WARNING, logger="megatron_bridge"):
        runtime_config_update(with_tokenizer(os.path.relpath(trained_with), iters=2))  # the same files
        assert "another tokenizer" not in caplog.text
        runtime_config_update(with_tokenizer(other, iters=2))
    assert (
        f"resuming from {ckpt!r} with another tokenizer than it was trained with (tokenizer.tokenizer_model "
        f"{trained_with!r} -> {other!r}): the same text becomes other token ids unless the files only moved; give the "
        "run's tokenizer to continue it"
    ) in caplog.text


@pytest.mark.timeout(120)
def test_adapters_in_the_peft_format_given_as_a_checkpoint_say_what_they_are(tmp_path):
    """`mbridge peft export` writes adapters for the peft library; a newcomer hands that directory
    to a command that reads our checkpoints."""
    exported = tmp_path / "adapters"
    exported.mkdir()
    (exported / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    expected = (
        f"no checkpoint in {str(exported)!r}: no latest_checkpointed_iteration.txt and not an iter_* directory; it "
        "holds adapters in the peft library's format (adapter_config.json), which load onto the Hugging Face base "
        "model with peft.PeftModel.from_pretrained: give the LoRA/DoRA run's checkpoint directory instead (its checkpoints/)"
    )
    with pytest.raises(FileNotFoundError) as err:
        resolve(str(exported))
    assert str(err.value) == expected
    from factories import source_tree_env

    proc = subprocess.run([sys.executable, "-m", "megatron_bridge", "peft", "merge", str(exported), str(tmp_path / "m")],
                          env=source_tree_env(), capture_output=True, text=True, timeout=100)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == f"mbridge peft merge: error: {expected}", proc.stderr


def test_an_iteration_directory_as_load_is_refused_with_the_settings_meant(tmp_path):
    """`checkpoint.load` reads a save directory's tracker: given one `iter_*` directory, the run
    used to start from scratch without a word."""
    iteration = tmp_path / "ckpt" / "iter_0000006"
    iteration.mkdir(parents=True)
    with pytest.raises(ConfigValidationError) as err:
        pretrain(config(load=str(iteration), iters=8), forward_step)
    assert err.value.errors == [
        f"checkpoint.load: {str(iteration)!r} is the directory of iteration 6, not a save directory with a tracker, "
        f"so the run would start from scratch (set checkpoint.load={tmp_path / 'ckpt'} and checkpoint.ckpt_step=6 to "
        f"resume from it, or checkpoint.pretrained_checkpoint={iteration} to start from its weights)"
    ]
    assert not torch.distributed.is_initialized()
