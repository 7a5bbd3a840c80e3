"""Blends keep their weights; blend phases switch the weights exactly at their iteration, also
across a resume; the console names the active phase."""

import logging

import numpy as np
import pytest
from factories import tiny_config

from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.data.builders import build_datasets
from megatron_bridge.data.indexed import IndexedDatasetWriter
from megatron_bridge.training.config import CheckpointConfig, GPTDatasetConfig, TrainingConfig, ValidationConfig, runtime_config_update
from megatron_bridge.runtime.tokenizers.tokenizer import NullTokenizer

EOD = 255


def write_dataset(prefix, low, high, docs=300, seed=0):
    """Documents of token ids in [low, high) only, so a sample tells which dataset it came from."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for _ in range(docs):
        n = int(rng.integers(20, 60))
        writer.add_document(np.append(rng.integers(low, high, n), EOD), [n + 1])
    writer.finalize()
    return str(prefix)


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    return write_dataset(d / "web", 0, 100, seed=1), write_dataset(d / "books", 100, 200, seed=2)


def source_of(tokens) -> int:
    tokens = np.asarray(tokens)
    tokens = tokens[tokens != EOD]
    assert ((tokens < 100).all() or (tokens >= 100).all()), "a sample mixes datasets"
    return int(tokens[0] >= 100)


def train_sources(web, books, phases=None, iters=250, tmp=None):
    cfg = tiny_config(
        train=TrainingConfig(train_iters=iters, global_batch_size=8, micro_batch_size=2),
        dataset=GPTDatasetConfig(seq_length=32, data_path=f"0.8 {web} 0.2 {books}", split="98,1,1", num_workers=0, blend_phases=phases, path_to_cache=tmp),
    )
    runtime_config_update(cfg)
    train, _, _ = build_datasets(cfg, NullTokenizer(256))
    return np.array([source_of(train[i]["tokens"]) for i in range(iters * 8)]), train


def test_a_blend_keeps_its_weights_over_2000_samples(blend):
    sources, _ = train_sources(*blend)
    share = sources.mean()
    print(f"books share over {len(sources)} samples: {share:.3f} (weight 0.2)")
    assert abs(share - 0.2) <= 0.03


def test_a_phase_switch_changes_the_weights_from_its_iteration_on(blend, tmp_path):
    phases = [{"name": "anneal", "start_iteration": 100, "weights": [0.1, 0.9]}]
    sources, train = train_sources(*blend, phases=phases)
    before, after = sources[: 100 * 8], sources[100 * 8 :]
    print(f"books share: {before.mean():.3f} before iteration 100 (weight 0.2), {after.mean():.3f} from it (weight 0.9)")
    assert abs(before.mean() - 0.2) <= 0.03 and abs(after.mean() - 0.9) <= 0.03
    assert abs(sources[96 * 8 : 100 * 8].mean() - 0.2) <= 0.2 and sources[100 * 8 : 104 * 8].mean() >= 0.7  # switches at once
    drawn = list(zip(train.dataset_index.tolist(), train.sample_index.tolist()))
    assert len(set(drawn)) == len(drawn)  # each dataset continues where the previous phase left it


def test_phase_indices_are_cached_with_path_to_cache(tmp_path):
    from types import SimpleNamespace

    from megatron_bridge.data.phase_schedule import Phase
    from megatron_bridge.data.phases import _cached, blending_indices

    calls = []

    def build():
        calls.append(1)
        return blending_indices([Phase("a", 0, (0.5, 0.5)), Phase("b", 3, (0.0, 1.0))], 2, 4, 40)

    config = SimpleNamespace(path_to_cache=str(tmp_path))
    first = _cached(config, {"x": 1}, build)
    second = _cached(config, {"x": 1}, build)
    assert len(calls) == 1 and all(np.array_equal(a, b) for a, b in zip(first, second))
    assert second[0][12:].tolist() == [1] * 28 and sorted(second[1][:12][second[0][:12] == 0].tolist()) == list(range(6))


def test_phase_errors(blend):
    web, books = blend
    cases = {
        "dataset.blend_phases.0.weights: 1 weights for 2 blend prefixes (give one weight per prefix of the blend, in its order)": [{"start_iteration": 5, "weights": [1.0]}],
        "dataset.blend_phases.0: needs exactly one of start_iteration and start_fraction, got neither (give one)": [{"weights": [1, 1]}],
        "dataset.blend_phases.1: starts at iteration 5, not after the previous phase (10) (give phases in increasing order of start)": [
            {"start_iteration": 10, "weights": [1, 1]},
            {"start_iteration": 5, "weights": [1, 1]},
        ],
        "dataset.blend_phases.0: starts at iteration 30, at or after the end of training (train.train_iters=20) (start it earlier or train longer)": [{"start_iteration": 30, "weights": [1, 1]}],
    }
    for expected, phases in cases.items():
        cfg = tiny_config(dataset=GPTDatasetConfig(seq_length=32, data_path=f"0.8 {web} 0.2 {books}", num_workers=0, blend_phases=phases))
        with pytest.raises(ConfigValidationError) as err:
            runtime_config_update(cfg)
        assert expected in err.value.errors, err.value.errors
    cfg = tiny_config(dataset=GPTDatasetConfig(seq_length=32, data_path=[web, books], num_workers=0, blend_phases=[{"start_fraction": 0.5, "weights": [1, 1]}]))
    with pytest.raises(ConfigValidationError, match="the first phase starts at iteration 10 and the blend has no weights for the iterations before it"):
        runtime_config_update(cfg)


@pytest.mark.timeout(400)
def test_resume_across_a_phase_switch_draws_the_samples_of_a_straight_run(blend, tmp_path, caplog):
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    web, books = blend

    def config(**ckpt):
        return tiny_config(
            train=TrainingConfig(train_iters=12, global_batch_size=8, micro_batch_size=4),
            dataset=GPTDatasetConfig(
                seq_length=32, data_path=f"0.8 {web} 0.2 {books}", split="98,1,1", num_workers=0,
                blend_phases=[{"name": "anneal", "start_iteration": 6, "weights": [0.0, 1.0]}],
            ),
            validation=ValidationConfig(eval_interval=None, eval_iters=1),
            checkpoint=CheckpointConfig(**ckpt),
        )  # fmt: skip

    def run(cfg):
        seen = {}

        def step(state, data_iterator, model):
            batch = next(data_iterator)
            if model.training:
                seen.setdefault(state.train_state.step, []).append(batch["tokens"].clone())
            return forward_step(state, iter([batch]), model)

        pretrain(cfg, step)
        return {k: [source_of(row) for t in v for row in t] + [int(t.sum()) for t in v] for k, v in seen.items()}

    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        straight = run(config())
    assert "data phase 1/2 'base' from iteration 0: web 0.80, books 0.20" in caplog.text
    assert "data phase 2/2 'anneal' from iteration 6: web 0.00, books 1.00" in caplog.text
    assert "data phase 2/2 anneal" in caplog.text  # on the progress line
    assert all(sum(straight[k][:8]) == 8 for k in range(6, 12))  # only books from iteration 6 on
    assert sum(sum(straight[k][:8]) for k in range(6)) < 6 * 8 / 2

    ckpt = str(tmp_path / "ckpt")
    first = config(save=ckpt)
    first.train.exit_interval = 4
    resumed = run(first)
    resumed.update(run(config(save=ckpt, load=ckpt)))
    assert sorted(resumed) == list(range(12))
    assert resumed == straight
