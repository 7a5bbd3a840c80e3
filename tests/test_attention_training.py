"""pretrain() of a tiny GPT for 5 iterations in fp32: the same losses with SDPA (attention_backend
auto) as with megatron-core's unfused DotProductAttention, for causal, grouped-query,
sliding-window and packed batches."""

from __future__ import annotations

import math

import pytest
import torch
from factories import tiny_config, tiny_llama_model
from megatron.core.transformer.enums import AttnBackend

pytestmark = pytest.mark.timeout(300)
# fp32 on the machine's device (a run picks the GPU where there is one): the CPU computes both the
# same way up to rounding; GPU kernels sum in other orders, and 5 Adam steps carry the difference.
TOLERANCE = 2e-4 if torch.cuda.is_available() else 1e-5


def random_samples(num, packed):
    """`num` sequences of 32 tokens: one random text each, or random samples of 4-30 tokens
    packed with a block-causal mask (the fine-tuning packing)."""
    import numpy as np
    import torch

    from megatron_bridge.data.packing import PackedSamples, PackedSFTDataset

    gen = np.random.default_rng(3)
    if packed:
        samples = [(gen.integers(0, 256, n), np.ones(n, dtype=np.uint8)) for n in gen.integers(4, 31, 48)]
        return PackedSFTDataset(PackedSamples.from_samples(samples, 32, seed=0), 32, num, seed=0, pad_id=0)
    texts = torch.from_numpy(gen.integers(0, 256, (num, 33)))
    return [
        {"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(32), "position_ids": torch.arange(32)} for t in texts
    ]


def data_provider(packed):
    from dataclasses import dataclass

    from megatron_bridge.training.config import DatasetProvider

    @dataclass
    class RandomData(DatasetProvider):
        seq_length: int = 32

        def build_datasets(self, context):
            return random_samples(context.train_samples, packed), None, None

    return RandomData(num_workers=0)


TRAINING_CASES = {
    "causal, grouped-query": dict(model={}),  # 4 heads, 2 key/value groups; one group per head: test_attention.py
    "sliding window, alternating": dict(model=dict(window_size=(5, 0), window_attn_skip_freq=2)),
    "packed, sliding window": dict(model=dict(window_size=(5, 0)), packed=True),
}


def losses_of(backend, case):
    from megatron_bridge.training.callbacks import Callback
    from megatron_bridge.training.config import TrainingConfig, ValidationConfig
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    class Losses(Callback):
        def __init__(self):
            self.losses = []

        def on_step_end(self, state, metrics):
            self.losses.append(metrics["lm loss"])

    spec = TRAINING_CASES[case]
    sections = dict(
        model=tiny_llama_model(attention_backend=backend, **spec["model"]),
        train=TrainingConfig(train_iters=5, global_batch_size=4, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
    )
    sections["dataset"] = data_provider(spec.get("packed", False))
    record = Losses()
    pretrain(tiny_config(**sections), forward_step, callbacks=[record])
    return record.losses


@pytest.mark.parametrize("case", list(TRAINING_CASES))
def test_five_iterations_give_the_same_losses_with_sdpa_and_unfused_attention(case):
    sdpa, unfused = losses_of(AttnBackend.auto, case), losses_of(AttnBackend.unfused, case)
    assert len(sdpa) == 5 and all(math.isfinite(x) for x in sdpa)
    assert sdpa[-1] < sdpa[0]  # it trains
    assert max(abs(a - b) for a, b in zip(sdpa, unfused)) < TOLERANCE, (sdpa, unfused)
