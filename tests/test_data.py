"""Samplers shard over data-parallel ranks and resume exactly; sample counts follow the schedule."""

import pytest
from factories import tiny_config

from megatron_bridge.data.builders import resumed_sample_counts, sample_counts
from megatron_bridge.data.samplers import CyclicSampler, GlobalBatchSampler, SequentialSampler
from megatron_bridge.training.config import TrainingConfig, ValidationConfig, runtime_config_update


def take(sampler, n):
    out = []
    for batch in sampler:
        out.append(batch)
        if len(out) == n:
            break
    return out


def test_sequential_sampler_shards_each_step_over_ranks():
    r0 = take(SequentialSampler(16, 0, 2, 0, 2), 3)
    r1 = take(SequentialSampler(16, 0, 2, 1, 2), 3)
    assert r0 == [[0, 1], [4, 5], [8, 9]] and r1 == [[2, 3], [6, 7], [10, 11]]
    assert len(list(SequentialSampler(15, 0, 2, 0, 2))) == 3  # the incomplete last step is dropped


def test_sequential_sampler_resumes_at_consumed_samples():
    straight = take(SequentialSampler(40, 0, 2, 1, 2), 6)
    resumed = take(SequentialSampler(40, 12, 2, 1, 2), 3)
    assert resumed == straight[3:]


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_sampler_reshuffles_epochs_and_resumes(sharding):
    sampler = CyclicSampler(12, 0, 2, 0, 2, data_sharding=sharding, seed=7)
    straight = take(sampler, 9)  # three steps per epoch, three epochs
    other = take(CyclicSampler(12, 0, 2, 1, 2, data_sharding=sharding, seed=7), 9)
    for i in (0, 3, 6):  # together the ranks visit every sample once per epoch
        assert sorted(sum(straight[i : i + 3] + other[i : i + 3], [])) == list(range(12))
    assert straight[0:3] != straight[3:6]  # ... in a new order each epoch
    resumed = take(CyclicSampler(12, 4 * 4, 2, 0, 2, data_sharding=sharding, seed=7), 5)
    assert resumed == straight[4:]


def test_cyclic_sampler_needs_one_full_step():
    with pytest.raises(ValueError, match="fewer than one step of micro_batch_size x data-parallel size = 8"):
        CyclicSampler(6, 0, 4, 0, 2)


def test_global_batch_sampler_yields_each_ranks_share():
    r1 = take(GlobalBatchSampler(32, 8, 2, 8, 1, 2), 2)
    assert r1 == [[12, 13, 14, 15], [20, 21, 22, 23]]
    with pytest.raises(ValueError, match="global_batch_size 6 is not a multiple of micro_batch_size x dp = 4"):
        GlobalBatchSampler(32, 0, 2, 6, 0, 2)


def test_sample_counts_follow_train_iters_eval_interval_and_eval_iters():
    cfg = tiny_config(
        train=TrainingConfig(train_iters=30, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=10, eval_iters=2, test_iters=3),
    )
    runtime_config_update(cfg)
    counts = sample_counts(cfg)
    assert (counts.train, counts.valid, counts.test) == (240, 2 * 8 * 4, 3 * 8)
    # resuming with the same config: the same datasets as an uninterrupted run
    assert resumed_sample_counts(cfg, 15, 15 * 8, 2 * 8) == counts
    assert resumed_sample_counts(cfg, 30, 240, 2 * 8 * 3) == counts  # finished: the last evaluation
    # the earlier jobs evaluated every 5 iterations and used a batch of 16
    assert resumed_sample_counts(cfg, 20, 20 * 16, 2 * 8 * 4) == type(counts)(20 * 16 + 10 * 8, 2 * 8 * 6, 3 * 8)
