"""Config fields the runtime reads, set away from their defaults, and what changes where the runtime
uses them: checkpoints on disk and what a resume restores, the train loop, the learning-rate
schedule, logging, data loaders, tokenizers, adapters and profilers.

Runs are few and short; whatever can be shown without training is built directly."""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import logging
import math
import warnings

import pytest
import torch
from factories import tiny_config

from megatron_bridge.training.callbacks import Callback
from megatron_bridge.training.checkpointing.manager import DefaultCheckpointManager
from megatron_bridge.training.config import (
    CheckpointConfig,
    LoggerConfig,
    ProfilingConfig,
    SchedulerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain


def training_rng_state(state) -> torch.Tensor:
    """The state of the default generator of the device the run trains on, the one its dropout
    draws from (a CUDA run leaves the CPU generator where the seeding put it)."""
    device = next(state.model[0].parameters()).device
    return (torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()).clone()


class Recorder(Callback):
    """What a run did: metrics per step, what reached the tracker, and state around the loop."""

    def __init__(self):
        self.steps: dict[int, dict] = {}
        self.logged: list[tuple[int, dict]] = []

    def on_train_start(self, state):
        self.rng_at_start = training_rng_state(state)
        optimizers = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
        self.optimizer_state_at_start = [s for o in optimizers for s in o.optimizer.state.values()]
        send = state.tracker.log_metrics

        def record(metrics, step):
            self.logged.append((step, dict(metrics)))
            send(metrics, step)

        state.tracker.log_metrics = record

    def on_step_end(self, state, metrics):
        self.steps[state.train_state.step] = metrics

    def on_train_end(self, state):
        self.rng_at_end = training_rng_state(state)


def short_run(iters=4, **sections):
    sections.setdefault("validation", ValidationConfig(eval_interval=None, eval_iters=0))
    return tiny_config(train=TrainingConfig(train_iters=iters, global_batch_size=8, micro_batch_size=2), **sections)


def checkpoint_groups(directory) -> set[str]:
    """Top-level entries of a torch_dist checkpoint (model parts, `optimizer`, `rng_state`)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {key.split(".")[0].split("/")[0] for key in keys}


class KeptManager(DefaultCheckpointManager):
    """The default manager, kept after the run so that the save strategy it built can be read."""

    last = None

    def __init__(self, config):
        super().__init__(config)
        KeptManager.last = self


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.timeout(300)
def test_what_checkpoints_hold_and_what_a_resume_restores(tmp_path, caplog):
    from megatron.core import dist_checkpointing

    from megatron_bridge.config.targets import register_target

    register_target(KeptManager)
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first = Recorder()
    cfg = short_run(checkpoint=CheckpointConfig(save=str(first_dir)))
    cfg.train.exit_duration_in_mins = 1e-9  # over after the first step: stop there, and save
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        state = pretrain(cfg, forward_step, callbacks=[first])
    assert state.train_state.step == 1
    assert "training stopped at iteration 1: exit_duration_in_mins=1e-09 reached" in caplog.text
    assert checkpoint_groups(first_dir / "iter_0000001") == {"embedding", "decoder", "optimizer", "rng_state"}
    assert first.optimizer_state_at_start == []  # a fresh Adam, so a restored one is told apart

    second = Recorder()
    cfg = short_run(
        iters=3,
        checkpoint=CheckpointConfig(
            load=str(first_dir), load_optim=False, load_rng=False, dist_ckpt_strictness="log_all",
            save=str(second_dir), save_interval=1, save_optim=False, save_rng=False,
            storage_writers_per_rank=2, ckpt_assume_constant_structure=True,
            custom_manager_class="test_field_effects_run.KeptManager",
        ),
    )  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.INFO):
        state = pretrain(cfg, forward_step, callbacks=[second])
    assert "resumed from iteration 1" in caplog.text and state.train_state.step == 3
    # load_optim=False: Adam starts afresh; load_rng=False: the RNG is not where the first run left it
    assert second.optimizer_state_at_start == []
    assert not torch.equal(second.rng_at_start, first.rng_at_end)
    # dist_ckpt_strictness='log_all': megatron-core names what the checkpoint holds and was not loaded
    (mismatch,) = [m for m in caplog.messages if "missing in the provided sharded state dict" in m]
    assert "'rng_state'" in mismatch and "optimizer.state.exp_avg.embedding.word_embeddings.weight" in mismatch
    for iteration in (2, 3):
        directory = second_dir / f"iter_{iteration:07d}"
        # save_optim=False, save_rng=False: model weights only
        assert checkpoint_groups(directory) == {"embedding", "decoder"}
        common = dist_checkpointing.load_common_state_dict(str(directory))
        assert common["saved_optimizer"] is False and common["saved_rng"] is False
        # storage_writers_per_rank=2: two files from the one rank (the first run wrote one)
        assert sorted(p.name for p in directory.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    assert [p.name for p in (first_dir / "iter_0000001").glob("*.distcp")] == ["__0_0.distcp"]
    # ckpt_assume_constant_structure: megatron-core's writer reuses its save plan from the second save on
    strategy = KeptManager.last._cached_save_strategy
    assert strategy.thread_count == 2
    assert strategy.use_cached_ckpt_structure is True and strategy.validated_cache_reuse is True


def test_a_load_directory_without_a_checkpoint_is_an_error_with_exit_on_missing_checkpoint(tmp_path):
    empty = tmp_path / "nothing_here"
    empty.mkdir()
    assert DefaultCheckpointManager(short_run(checkpoint=CheckpointConfig(load=str(empty)))).source() is None
    strict = short_run(checkpoint=CheckpointConfig(load=str(empty), exit_on_missing_checkpoint=True))
    with pytest.raises(FileNotFoundError, match="holds no checkpoint and exit_on_missing_checkpoint is set"):
        DefaultCheckpointManager(strict).source()


# ---------------------------------------------------------------------- the train loop
@pytest.mark.timeout(300)
def test_loop_settings_skip_steps_collect_garbage_and_silence_the_train_log(caplog):
    def nan_at_iteration_4(state, data_iterator, model):
        output, loss_func = forward_step(state, data_iterator, model)
        if state.train_state.step == 3:
            output = output * float("nan")
        return output, loss_func

    class Watch(Recorder):
        """Full collections (gc.collect) during the loop, by the iteration they followed, and the
        weights around iteration 2."""

        def on_train_start(self, state):
            super().on_train_start(state)
            self.state, self.collected_after = state, []
            gc.callbacks.append(self.collected)

        def collected(self, phase, info):
            if phase == "start" and info["generation"] == 2:
                self.collected_after.append(self.state.train_state.step)

        def on_step_start(self, state):
            if state.train_state.step == 1:
                self.before = [p.detach().clone() for p in state.model[0].parameters()]

        def on_step_end(self, state, metrics):
            super().on_step_end(state, metrics)
            if state.train_state.step == 2:
                self.after = [p.detach().clone() for p in state.model[0].parameters()]

        def on_train_end(self, state):
            gc.callbacks.remove(self.collected)

    cfg = short_run(validation=ValidationConfig(eval_interval=3, eval_iters=1))
    cfg.train.iterations_to_skip = [2]
    cfg.train.manual_gc = True
    cfg.train.manual_gc_interval = 2
    cfg.train.manual_gc_eval = False
    cfg.logger.log_interval = 1
    cfg.logger.skip_train_metrics_log = True
    cfg.rerun_state_machine.check_for_nan_in_loss = False
    watch = Watch()
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        state = pretrain(cfg, nan_at_iteration_4, callbacks=[watch])
    # iterations_to_skip: iteration 2's batch is consumed without a step
    assert watch.steps[2]["skipped"] is True and "lm loss" not in watch.steps[2]
    assert all(torch.equal(a, b) for a, b in zip(watch.before, watch.after))
    assert state.train_state.consumed_train_samples == 32
    # manual_gc_interval=2: after iterations 2 and 4 (and once as the loop starts); manual_gc_eval=False:
    # not before the evaluation after iteration 3
    assert watch.collected_after == [0, 2, 4]
    # skip_train_metrics_log: neither the console nor the tracker get training metrics; evaluations still
    assert "iteration 1/4" not in caplog.text and "validation at iteration 3" in caplog.text
    assert watch.logged and not any("iteration-time" in m or "lm loss" in m for _, m in watch.logged)
    assert [step for step, m in watch.logged if "lm loss validation" in m] == [3, 4]
    # check_for_nan_in_loss=False: the NaN loss of iteration 4 is reported, and the run completes
    # (by default it stops with an error naming the iteration: test_pretrain.py)
    assert math.isnan(watch.steps[4]["lm loss"]) and state.train_state.step == 4


@pytest.mark.timeout(300)
def test_skip_train_only_evaluates(caplog):
    from megatron_bridge.training.config import runtime_config_update

    old_style = short_run()
    old_style.train.skip_train = True  # the deprecated spelling becomes validation.skip_train
    runtime_config_update(old_style)
    assert old_style.validation.skip_train is True

    recorder = Recorder()
    cfg = short_run(validation=ValidationConfig(eval_iters=1, skip_train=True))
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        state = pretrain(cfg, forward_step, callbacks=[recorder])
    assert state.train_state.step == 0 and recorder.steps == {}
    assert "training stopped at iteration 0: validation.skip_train is set" in caplog.text
    assert "validation at iteration 0" in caplog.text


@pytest.mark.timeout(300)
def test_sample_based_warmup_stable_decay_schedule():
    """The learning rate after each of 7 steps of 8 samples: a warmup from lr_warmup_init over 16
    samples, the top rate, then the final decay of WSD, linear (lr_wsd_decay_style) over 16 samples
    that ends at lr_decay_samples=40, then min_lr."""
    top, low, start = 3e-3, 3e-4, 1e-3
    scheduler = SchedulerConfig(
        lr_decay_style="WSD", lr_warmup_samples=16, lr_warmup_init=start,
        lr_decay_samples=40, lr_wsd_decay_samples=16, lr_wsd_decay_style="linear",
    )  # fmt: skip
    cfg = tiny_config(
        train=TrainingConfig(train_samples=56, global_batch_size=8, micro_batch_size=4),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        scheduler=scheduler,
        logger=LoggerConfig(log_interval=1, log_loss_scale_to_tensorboard=False),
    )
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr) == (top, low)
    recorder = Recorder()
    pretrain(cfg, forward_step, callbacks=[recorder])
    lrs = [recorder.steps[i]["learning_rate"] for i in range(1, 8)]
    halfway_warm = start + (top - start) * 8 / 16  # (from the default lr_warmup_init=0: top / 2)
    halfway_decayed = low + (top - low) * (1 - 8 / 16)  # (exponential, the default: 1.42e-3)
    # (the default lr_decay_samples, the whole run, would keep the top rate until step 5)
    assert lrs == pytest.approx([halfway_warm, top, top, halfway_decayed, low, low, low], rel=1e-6)
    # log_loss_scale_to_tensorboard=False: the trackers get no loss scale
    assert len(recorder.logged) == 7 and not any("loss-scale" in m for _, m in recorder.logged)
    assert all("learning-rate" in m for _, m in recorder.logged)


@pytest.mark.timeout(300)
def test_batch_size_rampup_with_train_iters_ends_the_schedules_with_the_run(tmp_path):
    """Iteration-based training with a ramp 4 -> 6 -> 8 over 40 samples: 12 iterations consume 68
    samples (megatron-core's calculator, stepped as the train loop steps it), not 12 x 8 = 96. The
    LR reaches min_lr and the weight decay its end value at the last iteration, not before; a run
    stopped mid-ramp resumes at the batch size of the samples it had consumed."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    calculator = RampupBatchsizeNumMicroBatchesCalculator(8, 2, 1, False, 0, 4, 2, 40)
    consumed = [0]
    for _ in range(12):
        calculator.update(consumed[-1], consistency_check=True)
        consumed.append(consumed[-1] + calculator.get_current_global_batch_size())
    assert consumed[-1] == 68 and consumed[6] == 26  # the 6th iteration is the first of batch 6

    class Schedules(Callback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, state, metrics):
            groups = state.optimizer.param_groups
            wd = max(g["weight_decay"] for g in groups)
            self.seen.append((state.train_state.consumed_train_samples, metrics["learning_rate"], wd))

    def run(exit_interval=None):
        cfg = tiny_config(
            train=TrainingConfig(
                train_iters=12, global_batch_size=8, micro_batch_size=2, rampup_batch_size=[4, 2, 40],
                exit_interval=exit_interval,
            ),
            validation=ValidationConfig(eval_interval=None, eval_iters=0),
            scheduler=SchedulerConfig(weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1),
            checkpoint=CheckpointConfig(save=str(tmp_path) if exit_interval else None, load=str(tmp_path)),
        )
        schedules = Schedules()
        pretrain(cfg, forward_step, callbacks=[schedules])
        return cfg, schedules.seen

    cfg, first = run(exit_interval=7)
    assert [c for c, _, _ in first] == consumed[1:8]
    cfg, rest = run()
    seen = first + rest
    assert cfg.scheduler.lr_decay_steps == cfg.scheduler.wd_incr_steps == 68
    assert [c for c, _, _ in seen] == consumed[1:]
    top, low = cfg.optimizer.lr, cfg.optimizer.min_lr
    lrs = [lr for _, lr, _ in seen]
    assert lrs == pytest.approx([low + (top - low) * (1 - c / 68) for c in consumed[1:]], rel=1e-6)
    assert lrs[-1] == pytest.approx(low, rel=1e-9) and lrs[-2] > low * 1.1
    wds = [wd for _, _, wd in seen]
    assert wds[-1] == pytest.approx(0.1, rel=1e-9) and wds[-2] < 0.1 * 0.95


# ---------------------------------------------------------------------- logging
@contextlib.contextmanager
def logging_restored(*names):
    """Put back the levels, filters, handlers and propagation of these loggers (and the root)."""
    from megatron_bridge.training import setup

    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in names)]
    saved = [(lg, lg.level, list(lg.filters), list(lg.handlers), lg.propagate) for lg in loggers]
    levels_before_filtering = dict(setup._LEVEL_BEFORE_FILTERING)
    try:
        yield
    finally:
        for lg, level, filters, handlers, propagate in saved:
            lg.setLevel(level)
            lg.filters[:], lg.handlers[:], lg.propagate = filters, handlers, propagate
        setup._LEVEL_BEFORE_FILTERING.clear()
        setup._LEVEL_BEFORE_FILTERING.update(levels_before_filtering)


def test_logging_settings(caplog):
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    from megatron_bridge.training.setup import _ROUTINE_MESSAGES, configure_logging, init_rerun_state_machine
    from megatron_bridge.training.state import GlobalState

    def configure_then_start_the_rerun_machine(logger_cfg):
        cfg = tiny_config(logger=logger_cfg)
        configure_logging(GlobalState(cfg=cfg))
        caplog.clear()
        destroy_rerun_state_machine()  # one per process; a run makes its own
        init_rerun_state_machine(cfg)  # megatron-core warns "RerunStateMachine initialized in mode ..."
        destroy_rerun_state_machine()
        return "RerunStateMachine initialized" in caplog.text

    names = ("megatron_bridge", "megatron.core", "filelock", *_ROUTINE_MESSAGES)
    with logging_restored(*names):
        logging.getLogger().setLevel(logging.WARNING)  # Python's default, whatever the test runner set
        ours, library, other = (logging.getLogger(n) for n in ("megatron_bridge", "filelock", "some.other.library"))
        routine_shown = configure_then_start_the_rerun_machine(LoggerConfig())
        assert not routine_shown and not ours.isEnabledFor(logging.DEBUG)
        assert library.isEnabledFor(logging.CRITICAL) and not other.isEnabledFor(logging.DEBUG)

        routine_shown = configure_then_start_the_rerun_machine(
            LoggerConfig(
                logging_level=logging.DEBUG,
                filter_warnings=False,
                modules_to_filter=["filelock"],
                set_level_for_all_loggers=True,
            )
        )
        assert routine_shown  # filter_warnings=False: megatron-core's routine warnings are shown
        assert ours.isEnabledFor(logging.DEBUG)  # logging_level
        assert not library.isEnabledFor(logging.CRITICAL)  # modules_to_filter: silenced entirely
        # set_level_for_all_loggers: every logger without a level of its own follows logging_level
        assert logging.getLogger().level == logging.DEBUG and other.isEnabledFor(logging.DEBUG)


def test_tensorboard_queue_size_reaches_the_event_writer(tmp_path):
    from megatron_bridge.training.loggers.factory import instantiate, tracker_specs

    cfg = tiny_config(logger=LoggerConfig(tensorboard_dir=str(tmp_path), tensorboard_queue_size=7))
    (spec,) = tracker_specs(cfg)
    tracker = instantiate(spec)
    try:
        # events wait in this queue for the writer thread (tensorboard's EventFileWriter)
        assert tracker.writer._async_writer._byte_queue.maxsize == 7
    finally:
        tracker.close()


# ---------------------------------------------------------------------- data
class Indices(torch.utils.data.Dataset):
    """Sample i is {"index": i}."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        return {"index": torch.tensor(i)}


def batches_of(cfg, size=7, pin_memory=False, take=None):
    from megatron_bridge.data.loaders import build_iterator

    iterator = build_iterator(cfg, Indices(size), 0, 2, 2, size, 0, 1, pin_memory)
    drawn = []
    for batch in iterator:
        drawn.append(batch["index"].tolist())
        if take is not None and len(drawn) == take:
            break
    return drawn, iterator


def test_dataloader_settings():
    from megatron_bridge.training.config import MockGPTDatasetConfig

    def dataset(**kw):
        return tiny_config(dataset=MockGPTDatasetConfig(seq_length=32, num_workers=0, **kw))

    assert batches_of(dataset())[0] == [[0, 1], [2, 3], [4, 5]]  # in order, the short tail dropped
    assert batches_of(dataset(drop_last=False))[0] == [[0, 1], [2, 3], [4, 5], [6]]
    cyclic, _ = batches_of(dataset(dataloader_type="cyclic"), take=6)  # endless, reshuffled each pass
    assert cyclic[:3] != [[0, 1], [2, 3], [4, 5]]
    first_pass, second_pass = [i for b in cyclic[:3] for i in b], [i for b in cyclic[3:] for i in b]
    assert sorted(first_pass) == sorted(second_pass) == list(range(6))

    # pin_memory reaches the DataLoader where the device can pin (the run passes pin_memory=True on
    # GPUs); on a machine without an accelerator torch says that it was asked to pin and cannot
    def asked_to_pin(cfg) -> bool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, iterator = batches_of(cfg, pin_memory=True)
        return iterator._pin_memory or any("'pin_memory' argument is set as true" in str(w.message) for w in caught)

    assert asked_to_pin(dataset()) and not asked_to_pin(dataset(pin_memory=False))


@pytest.mark.timeout(120)
def test_persistent_workers_outlive_a_pass_only_when_set():
    from megatron_bridge.training.config import MockGPTDatasetConfig

    def workers_after_a_pass(**kw):
        cfg = tiny_config(dataset=MockGPTDatasetConfig(seq_length=32, num_workers=1, **kw))
        gc.collect()  # garbage of earlier runs is freed here, not in the forked worker
        drawn, iterator = batches_of(cfg)
        assert drawn == [[0, 1], [2, 3], [4, 5]]
        alive = [w.is_alive() for w in iterator._workers]
        iterator._shutdown_workers()
        return alive

    assert workers_after_a_pass() == [True]  # the default keeps the worker for another pass
    assert workers_after_a_pass(persistent_workers=False) == [False]


@pytest.mark.timeout(120)
def test_worker_start_method_spawns_workers_that_draw_the_same_batches():
    from megatron_bridge.training.config import MockGPTDatasetConfig

    cfg = tiny_config(dataset=MockGPTDatasetConfig(seq_length=32, num_workers=1, worker_start_method="spawn"))
    drawn, iterator = batches_of(cfg)
    assert drawn == [[0, 1], [2, 3], [4, 5]]
    assert [type(w).__name__ for w in iterator._workers] == ["SpawnProcess"]
    iterator._shutdown_workers()
    cfg.dataset.worker_start_method = "fork"
    drawn, iterator = batches_of(cfg, take=1)
    assert drawn == [[0, 1]] and [type(w).__name__ for w in iterator._workers] == ["ForkProcess"]
    iterator._shutdown_workers()


def test_finetuning_dataset_settings(tmp_path):
    from megatron_bridge.data.builders import SampleCounts
    from megatron_bridge.data.finetuning import build_finetuning_datasets
    from megatron_bridge.data.hf_local import DataSourceError
    from megatron_bridge.training.config import FinetuningDatasetConfig
    from megatron_bridge.runtime.tokenizers.tokenizer import NullTokenizer

    for split in ("training", "validation", "test"):
        rows = [{"question": f"{i} {i + 1}", "reply": f"{i + 2}"} for i in range(1, 9)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts, tokenizer = SampleCounts(train=8, valid=8, test=8), NullTokenizer(256)

    def build(**kw):
        data = FinetuningDatasetConfig(dataset_root=str(tmp_path), seq_length=16, **kw)
        return build_finetuning_datasets(data, tokenizer, counts)

    with pytest.raises(DataSourceError, match="unknown column 'input'"):
        build()  # the data has no input/output columns
    columns = {"prompt_key": "question", "answer_key": "reply"}
    train, valid, test = build(dataset_kwargs=columns)
    assert valid is not None and test is not None
    assert sorted(train[i]["tokens"][:3] for i in range(8)) == [[i, i + 1, i + 2] for i in range(1, 9)]
    train, valid, test = build(dataset_kwargs=columns, do_validation=False, do_test=False)
    assert train is not None and valid is None and test is None


def test_finetuning_samples_whose_answer_is_truncated_away(tmp_path, caplog):
    from megatron_bridge.data.builders import SampleCounts
    from megatron_bridge.data.finetuning import build_finetuning_datasets
    from megatron_bridge.training.config import ConfigValidationError, FinetuningDatasetConfig
    from megatron_bridge.training.console import eval_line
    from megatron_bridge.runtime.tokenizers.tokenizer import NullTokenizer

    def build(long_prompts: int):
        rows = [{"input": " ".join(map(str, range(1, 41 if i < long_prompts else 6))), "output": "7 8 9"} for i in range(8)]
        (tmp_path / "training.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        data = FinetuningDatasetConfig(dataset_root=str(tmp_path), seq_length=16)
        return build_finetuning_datasets(data, NullTokenizer(256), SampleCounts(train=8, valid=0, test=0))

    with pytest.raises(ConfigValidationError) as err:
        build(long_prompts=8)  # it used to train on no token at all, reporting a NaN loss
    assert err.value.errors == [
        "dataset.seq_length: 8 of the 8 train samples keep no answer token within dataset.seq_length=16: their "
        "prompts fill it (raise dataset.seq_length (up to model.seq_length) or shorten the prompts)"
    ]
    with caplog.at_level(logging.WARNING, logger="megatron_bridge"):
        train, _, _ = build(long_prompts=3)
    assert sum(sum(train[i]["loss_mask"]) == 0 for i in range(8)) == 3
    assert (
        "3 of the 8 train samples keep no answer token within dataset.seq_length=16 (their prompts fill it): they "
        "add nothing to the loss; raise dataset.seq_length (up to model.seq_length) or shorten the prompts"
    ) in caplog.text
    # a step of such samples alone has no loss: shown as NaN, and so is its perplexity (not e^20)
    assert eval_line(2, "validation", {"lm loss": math.nan}) == "validation at iteration 2 | lm loss NAN | lm loss PPL NAN"
    from megatron_bridge.training.metrics import eval_metrics

    tracked = eval_metrics({"lm loss": math.nan}, "validation", with_ppl=True)  # the trackers get the same
    assert math.isnan(tracked["lm loss validation"]) and math.isnan(tracked["lm loss validation ppl"])


def test_tokenizer_special_tokens_and_extra_ids(tmp_path):
    from text_data import train_tokenizer

    from megatron_bridge.training.tokenizers.config import TokenizerConfig
    from megatron_bridge.runtime.tokenizers.tokenizer import build_tokenizer

    path = train_tokenizer(tmp_path)
    plain = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path))
    extended = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=path,
            special_tokens=["<tool_call>"],
            vocab_extra_ids=3,
        )
    )
    assert extended.vocab_size == plain.vocab_size + 4
    assert len(plain.tokenize("<tool_call>")) > 1 and len(plain.tokenize("<extra_id_2>")) > 1
    assert extended.tokenize("<tool_call>") == [plain.vocab_size]  # one token each, after the vocabulary
    assert extended.tokenize("<extra_id_2>") == [plain.vocab_size + 3]
    null = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=256, vocab_extra_ids=3))
    assert null.vocab_size == 259 and null.eod == 258


def test_a_tokenizer_rewritten_in_place_is_loaded_again(tmp_path):
    """Loaded tokenizers are reused while their files are unchanged; rewriting tokenizer.json in
    the same directory (the directory's own time does not move) loads the new one."""
    import os

    from text_data import train_tokenizer

    from megatron_bridge.training.tokenizers.config import TokenizerConfig
    from megatron_bridge.runtime.tokenizers.tokenizer import build_tokenizer

    cfg = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=train_tokenizer(tmp_path, vocab_size=300))
    first = build_tokenizer(cfg)
    assert build_tokenizer(cfg) is first
    directory_time = os.stat(tmp_path).st_mtime_ns
    train_tokenizer(tmp_path, vocab_size=280)
    os.utime(tmp_path, ns=(directory_time, directory_time))
    assert build_tokenizer(cfg).vocab_size == 280


# ---------------------------------------------------------------------- adapters
def test_lora_initialization_and_dropout_position():
    from megatron_bridge.peft import LoRA
    from megatron_bridge.peft.apply import adapters
    from megatron_bridge.peft.offline import single_process_model

    def adapter_update(lora, x):
        """(update in training mode, update in eval mode) of the first adapted layer, and the layer."""
        cfg = tiny_config()
        cfg.peft = lora
        with single_process_model(cfg) as model:
            layer = next(iter(adapters(model)))
            base = layer.base_layer(x)[0]
            layer.train()
            torch.manual_seed(0)
            trained = layer(x)[0] - base
            layer.eval()
            return trained, layer(x)[0] - base, layer

    x = torch.randn(8, 2, 64)
    changed = LoRA(
        dim=4, lora_A_init_method="normal", lora_B_init_method="kaiming", dropout=0.5, dropout_position="post"
    )
    trained, evaluated, layer = adapter_update(changed, x)
    # A drawn from N(0, 0.02) (xavier by default: std ~0.17); B kaiming-uniform (zero by default)
    assert layer.lora_A.std() < 0.03 and layer.lora_B.abs().min() > 0
    assert layer.lora_B.abs().max() <= 1 / math.sqrt(4)
    # dropout after the adapter: each output element is dropped or doubled
    dropped = trained == 0
    assert 0.3 < dropped.float().mean() < 0.7
    assert torch.allclose(trained[~dropped], 2 * evaluated[~dropped], rtol=1e-4, atol=1e-6)
    # dropout on the input (the default) mixes the kept inputs instead
    trained, evaluated, _ = adapter_update(LoRA(dim=4, lora_B_init_method="kaiming", dropout=0.5), x)
    assert (trained == 0).float().mean() < 0.01


# ---------------------------------------------------------------------- profiling
def test_profiler_records_shapes_when_asked(tmp_path):
    from megatron_bridge.training.profiling import StepProfiler

    def trace_has_shapes(record_shapes: bool, directory) -> bool:
        profiling = ProfilingConfig(
            use_pytorch_profiler=True, profile_step_start=1, profile_step_end=2, profile_dir=str(directory),
            record_shapes=record_shapes,
        )  # fmt: skip
        profiler = StepProfiler(tiny_config(profiling=profiling), rank=0, device="cpu")
        profiler.step_start(0)
        a = torch.randn(32, 32)
        (a @ a).sum()
        profiler.step_end(1)
        profiler.close()
        (path,) = glob.glob(f"{directory}/rank0.*.pt.trace.json")
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        return any("Input Dims" in e.get("args", {}) for e in events)

    assert trace_has_shapes(True, tmp_path / "shapes") and not trace_has_shapes(False, tmp_path / "plain")


def test_gpu_profiling_settings_reach_torch_cuda(tmp_path, monkeypatch):
    """record_memory_history, memory_snapshot_path and nvtx_ranges need CUDA (a CPU run refuses
    them). Here the torch.cuda calls the profiler makes on a GPU are recorded instead of made."""
    from megatron_bridge.training.profiling import StepProfiler

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    profiling = ProfilingConfig(
        record_memory_history=True, memory_snapshot_path="memory/window.pickle", nvtx_ranges=True,
        profile_step_start=2, profile_step_end=3, profile_dir=str(tmp_path),
    )  # fmt: skip
    profiler = StepProfiler(tiny_config(profiling=profiling), rank=0, device="cuda")
    for completed in range(3):
        profiler.step_start(completed)
        profiler.step_end(completed + 1)
    profiler.close()
    assert calls == [
        ("push", "iteration 1"), ("pop",),
        ("push", "iteration 2"), ("record", {"max_entries": 100_000}), ("pop",),
        ("dump", str(tmp_path / "memory" / "window.pickle")), ("record", {"enabled": None}),
        ("push", "iteration 3"), ("pop",),
    ]  # fmt: skip
    assert (tmp_path / "memory").is_dir()
