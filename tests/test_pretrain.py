"""pretrain() in one process on CPU (gloo): real megatron-core training of a tiny GPT."""

import logging
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from factories import tiny_config

from megatron_bridge.training.callbacks import Callback
from megatron_bridge.training.config import (
    ConfigValidationError,
    DatasetProvider,
    GPTDatasetConfig,
    LoggerConfig,
    OptimizerConfigOverrideProvider,
    SchedulerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain

pytestmark = pytest.mark.timeout(300)


class Record(Callback):
    def __init__(self):
        self.losses, self.events, self.evals = [], [], []
        self.param_groups = None

    def on_train_start(self, state):
        self.events.append("train_start")
        self.param_groups = [
            {"n": len(g["params"]), "wd_mult": g.get("wd_mult"), "max_lr": g.get("max_lr")}
            for g in state.optimizer.param_groups
        ]

    def on_step_start(self, state):
        self.events.append("step_start")

    def on_step_end(self, state, metrics):
        self.events.append("step_end")
        self.losses.append(metrics["lm loss"])

    def on_eval_start(self, state):
        self.events.append("eval_start")

    def on_eval_end(self, state, metrics):
        self.events.append("eval_end")
        self.evals.append(metrics)

    def on_train_end(self, state):
        self.events.append("train_end")


def mean(xs):
    return sum(xs) / len(xs)


def test_tiny_gpt_trains_on_mock_data_with_falling_loss(caplog):
    cfg = tiny_config(train=TrainingConfig(train_iters=30, global_batch_size=8, micro_batch_size=2))
    cfg.logger.log_interval = 10
    rec = Record()
    with caplog.at_level("INFO", logger="megatron_bridge"):
        state = pretrain(cfg, forward_step, callbacks=[rec])
    assert state.train_state.step == 30 and state.train_state.consumed_train_samples == 240
    assert len(rec.losses) == 30 and all(math.isfinite(x) for x in rec.losses)
    assert mean(rec.losses[-5:]) < mean(rec.losses[:5]) - 1.0
    # events in order; validation every 10 iterations and once at the end, then test
    assert rec.events[:3] == ["train_start", "step_start", "step_end"]
    assert rec.events.count("eval_start") == 2 + 1 + 1 and rec.events[-1] == "eval_end"
    # the console shows progress, loss and throughput
    assert "[ 33%] iteration 10/30 | consumed samples 80 |" in caplog.text
    assert "[100%] iteration 30/30" in caplog.text and "tokens/s" in caplog.text and "lm loss" in caplog.text
    assert "validation at iteration 30 | lm loss" in caplog.text
    assert not torch.distributed.is_initialized()  # it created the group, so it destroyed it


@dataclass
class CountingData(DatasetProvider):
    """A user dataset: sequences of +1 steps starting at random tokens."""

    seq_length: int = 32
    vocab: int = 256
    calls: int = 0

    def build_datasets(self, context):
        CountingData.last_context = context
        return _Counting(context.train_samples, self.seq_length, self.vocab), _Counting(16, self.seq_length, self.vocab), None


class _Counting(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(0)
        self.starts = torch.randint(0, vocab, (n,), generator=g)
        self.seq, self.vocab = seq, vocab

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        text = (self.starts[i] + torch.arange(self.seq + 1)) % self.vocab
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": torch.ones(self.seq),
            "position_ids": torch.arange(self.seq),
            "attention_mask": None,
        }

    @staticmethod
    def collate_fn(items):
        return {k: (torch.stack([it[k] for it in items]) if items[0][k] is not None else None) for k in items[0]}


def test_user_dataset_provider_gets_a_filled_context_and_trains():
    cfg = tiny_config(
        train=TrainingConfig(train_iters=25, global_batch_size=8, micro_batch_size=4),
        dataset=CountingData(num_workers=0),
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
    )
    rec = Record()
    pretrain(cfg, forward_step, callbacks=[rec])
    ctx = CountingData.last_context
    assert (ctx.train_samples, ctx.valid_samples, ctx.test_samples) == (200, 8, 8)
    assert ctx.tokenizer is not None and ctx.tokenizer.vocab_size == 256
    assert ctx.pg_collection is not None and ctx.pg_collection.dp.size() == ctx.pg_collection.tp.size() == 1
    assert mean(rec.losses[-5:]) < mean(rec.losses[:5]) - 0.5


@pytest.mark.parametrize(
    "returned, shown",
    [((), "tuple of 0"), ([None, None], "list of 2"), (_Counting(8, 32, 256), "_Counting")],
)
def test_a_provider_returning_other_than_three_splits_is_named(returned, shown):
    from megatron_bridge.data.builders import build_datasets

    @dataclass
    class Returns(DatasetProvider):
        def build_datasets(self, context):
            return returned

    cfg = tiny_config(dataset=Returns(num_workers=0))
    with pytest.raises(TypeError) as err:
        build_datasets(cfg, tokenizer=None)
    assert str(err.value) == (
        f"cfg.dataset: Returns.build_datasets returned a {shown}, not (train, valid, test); return a tuple of "
        "three datasets, with None for a split it does not provide"
    )


class EmbeddingLR(OptimizerConfigOverrideProvider):
    """Standard groups plus a lower LR for embeddings."""

    def build_config_overrides(self, context):
        from megatron.core.optimizer import ParamGroupOverride, ParamKey

        overrides = super().build_config_overrides(context)
        overrides[ParamKey(name="*embedding*")] = ParamGroupOverride(max_lr=1e-4)
        return overrides


def test_custom_optimizer_override_provider_changes_param_groups():
    default, custom = Record(), Record()
    pretrain(tiny_config(train=TrainingConfig(train_iters=2, global_batch_size=8, micro_batch_size=2)), forward_step, callbacks=[default])
    pretrain(
        tiny_config(
            train=TrainingConfig(train_iters=2, global_batch_size=8, micro_batch_size=2),
            optimizer_config_override_provider=EmbeddingLR(),
        ),
        forward_step,
        callbacks=[custom],
    )
    assert {g["max_lr"] for g in default.param_groups} == {3e-3}
    assert {g["wd_mult"] for g in default.param_groups} == {0.0, 1.0}  # no decay on biases/norms
    assert 1e-4 in {g["max_lr"] for g in custom.param_groups}
    assert len(custom.param_groups) > len(default.param_groups)


def _stopped_by_the_loss(spoil):
    """(the error, the events) of a 6-iteration run whose forward step passes its output
    through `spoil(step, micro batch of the step, output)`."""
    rec, calls = Record(), []

    def spoiled(state, data_iterator, model):
        output, loss_func = forward_step(state, data_iterator, model)
        calls.append(state.train_state.step)
        return spoil(state.train_state.step, calls.count(state.train_state.step), output), loss_func

    cfg = tiny_config(train=TrainingConfig(train_iters=6, global_batch_size=8, micro_batch_size=2))
    with pytest.raises(RuntimeError) as err:
        pretrain(cfg, spoiled, callbacks=[rec])
    assert not torch.distributed.is_initialized()
    return str(err.value), rec.events, calls


def test_nan_loss_is_reported_and_not_trained_on():
    # the third iteration
    err, events, _ = _stopped_by_the_loss(lambda step, _, out: out * float("nan") if step == 2 else out)
    assert "found NaN in the loss" in err
    assert "iteration 3" in err
    assert events.count("step_end") == 2  # no optimizer step with the NaN loss


def test_an_inf_loss_in_one_micro_batch_stops_the_step_before_its_update():
    """The losses of a step are checked together after its last micro batch (one wait for the
    device per step); one bad micro batch among four still stops the run before the update."""
    err, events, calls = _stopped_by_the_loss(
        lambda step, micro, out: out.masked_fill(torch.ones_like(out, dtype=torch.bool), float("inf"))
        if (step, micro) == (1, 2) else out
    )
    assert "found Inf in the loss" in err
    assert "iteration 2" in err
    assert calls.count(1) == 4  # the step's other micro batches ran
    assert events.count("step_end") == 1


def test_a_nan_loss_in_evaluation_stops_the_run():
    """Evaluation batches check their losses together too, after the batch's micro batches."""
    evaluating = []

    def spoiled(state, data_iterator, model):
        output, loss_func = forward_step(state, data_iterator, model)
        evaluating.append(not torch.is_grad_enabled())
        return (output * float("nan") if evaluating[-1] else output), loss_func

    cfg = tiny_config(
        train=TrainingConfig(train_iters=4, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=2, eval_iters=1),
    )
    with pytest.raises(RuntimeError, match="found NaN in the loss"):
        pretrain(cfg, spoiled)
    assert evaluating.count(True) == 4  # the evaluation batch's four micro batches ran first
    assert not torch.distributed.is_initialized()


def test_a_loss_computed_outside_a_step_is_checked_at_once():
    """A user's own loop that calls the loss function is not deferred to a check it never makes."""
    from megatron_bridge.runtime import cpu_backend
    from megatron_bridge.training.gpt_step import masked_next_token_loss
    from megatron_bridge.training.state import GlobalState

    state = GlobalState(tiny_config())
    output = torch.full((2, 4), float("nan"), requires_grad=True)
    activated = cpu_backend.activate()  # megatron-core's error message names the CUDA device
    try:
        with pytest.raises(RuntimeError, match="found NaN in the loss"):
            masked_next_token_loss(torch.ones(2, 4), output, state)
    finally:
        from megatron.core.rerun_state_machine import destroy_rerun_state_machine

        destroy_rerun_state_machine()  # the loss check made one; a run in this process makes its own
        if activated:
            cpu_backend.deactivate()
    assert state.unchecked_losses is None


def _write_indexed_dataset(prefix, vocab, docs=200, seed=0):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(docs):
        start, length = rng.integers(0, vocab - 1), rng.integers(8, 60)
        doc = (start + np.arange(length)) % (vocab - 1)
        builder.add_document(torch.from_numpy(np.append(doc, vocab - 1).astype(np.int64)), [length + 1])
    builder.finalize(f"{prefix}.idx")


def test_indexed_dataset_written_by_the_test_trains(tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    _write_indexed_dataset(prefix, vocab=256)
    cfg = tiny_config(
        train=TrainingConfig(train_iters=25, global_batch_size=8, micro_batch_size=4),
        dataset=GPTDatasetConfig(seq_length=32, data_path=prefix, split="90,5,5", num_workers=0, path_to_cache=str(tmp_path / "cache")),
    )
    rec = Record()
    pretrain(cfg, forward_step, callbacks=[rec])
    assert cfg.dataset.blend == ([prefix], None)
    assert mean(rec.losses[-5:]) < mean(rec.losses[:5]) - 0.5
    assert any((tmp_path / "cache").iterdir())  # megatron-core cached its sample indices


def test_blend_weights_from_data_path(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write_indexed_dataset(a, vocab=256, seed=1)
    _write_indexed_dataset(b, vocab=256, seed=2)
    cfg = tiny_config(
        train=TrainingConfig(train_iters=3, global_batch_size=8, micro_batch_size=4),
        dataset=GPTDatasetConfig(seq_length=32, data_path=f"0.3 {a} 0.7 {b}", split="98,1,1", num_workers=0),
    )
    state = pretrain(cfg, forward_step)
    assert cfg.dataset.blend == ([a, b], [0.3, 0.7]) and state.train_state.step == 3


def test_tensorboard_scalars_are_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    cfg = tiny_config(
        train=TrainingConfig(train_iters=6, global_batch_size=8, micro_batch_size=2),
        logger=LoggerConfig(log_interval=2, tensorboard_dir=str(tb)),
    )
    pretrain(cfg, forward_step)
    events = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("lm loss", "learning-rate", "grad-norm", "iteration-time", "tokens-per-second", "lm loss validation"):
        assert tag in tags, tags
    assert [e.step for e in events.Scalars("lm loss")] == [2, 4, 6]


def test_learning_rates_in_tensorboard_follow_a_fractional_warmup_and_a_default_wsd_decay(tmp_path):
    """The LR after each of 4 steps of 8 samples, read back from TensorBoard: a warmup of
    0.3 x 32 = 9.6 samples (not rounded to 9), then WSD whose final phase, left unset, is the
    whole decay (NVIDIA Megatron Bridge's default), linear from the peak to min_lr at 32 samples."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    top, low = 3e-3, 3e-4
    tb = tmp_path / "tb"
    cfg = tiny_config(
        train=TrainingConfig(train_iters=4, global_batch_size=8, micro_batch_size=4),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        scheduler=SchedulerConfig(lr_warmup_fraction=0.3, lr_decay_style="WSD", lr_wsd_decay_style="linear"),
        logger=LoggerConfig(log_interval=1, tensorboard_dir=str(tb)),
    )
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr) == (top, low)
    pretrain(cfg, forward_step)
    events = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("learning-rate")}
    # after 8 samples: warming up (8 / 9.6); after 16, 24, 32: WSD at 16/32, 24/32, 32/32 of its phase
    expected = {1: top * 8 / 9.6, 2: low + (top - low) * 0.5, 3: low + (top - low) * 0.25, 4: low}
    assert logged == pytest.approx(expected, rel=1e-6)


def test_training_set_smaller_than_a_global_batch_is_a_clear_error():
    @dataclass
    class Tiny(DatasetProvider):
        def build_datasets(self, context):
            return _Counting(4, 32, 256), None, None

    cfg = tiny_config(dataset=Tiny(num_workers=0), validation=ValidationConfig(eval_iters=0))
    with pytest.raises(ValueError, match="the training set has 4 samples, fewer than one global batch of 8"):
        pretrain(cfg, forward_step)
    assert not torch.distributed.is_initialized()


@pytest.mark.timeout(120)
def test_a_provider_without_the_splits_a_run_uses(caplog):
    @dataclass
    class Only(DatasetProvider):
        train: bool = True

        def build_datasets(self, context):
            return (_Counting(context.train_samples, 32, 256) if self.train else None), None, None

    no_training = tiny_config(dataset=Only(train=False, num_workers=0), validation=ValidationConfig(eval_iters=0))
    with pytest.raises(ConfigValidationError) as err:
        pretrain(no_training, forward_step)  # it used to end at once as a completed run
    assert err.value.errors == [
        "dataset: Only gives no training set (None), but train.train_iters=20 asks for training (return a training "
        "dataset from build_datasets, or set validation.skip_train=true to only evaluate)"
    ]
    assert not torch.distributed.is_initialized()

    no_validation = tiny_config(
        train=TrainingConfig(train_iters=2, global_batch_size=8, micro_batch_size=4),
        dataset=Only(num_workers=0),
        validation=ValidationConfig(eval_interval=1, eval_iters=2),
    )
    with caplog.at_level(logging.WARNING, logger="megatron_bridge"):
        assert pretrain(no_validation, forward_step).train_state.step == 2
    assert (
        "no validation set: Only gives none, so validation.eval_iters=2 evaluates nothing "
        "(set validation.eval_iters=0 to run without evaluation)"
    ) in caplog.text


def test_forward_step_signatures_are_adapted():
    seen = []

    def without_state(data_iterator, model):
        seen.append("plain")
        device = next(model.parameters()).device  # batches come on the CPU; the model is on the GPU where there is one
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in next(data_iterator).items()}
        out = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
        from functools import partial

        from megatron_bridge.training.gpt_step import masked_next_token_loss

        return out, partial(masked_next_token_loss, batch["loss_mask"])

    pretrain(tiny_config(train=TrainingConfig(train_iters=1, global_batch_size=8, micro_batch_size=2), validation=ValidationConfig(eval_iters=0)), without_state)
    assert seen.count("plain") == 4  # four micro batches
