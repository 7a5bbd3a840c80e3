"""The GPU lane (`pytest -m gpu`): what only a CUDA GPU shows. One process each, NCCL, real
megatron-core on the GPU: fp32 and bf16 training, a checkpoint saved from the GPU and resumed
exactly, Hugging Face weights imported onto the GPU with transformers' logits, LoRA, and the
planner's memory estimate against `torch.cuda.max_memory_allocated`.

Skipped without CUDA. The configs the lane trains are built and resolved on every machine (the
last test), so a broken config shows on CPU too."""

from __future__ import annotations

import gc

import pytest
import torch
from factories import tiny_config, tiny_llama_model, tiny_model

from megatron_bridge.training.callbacks import Callback
from megatron_bridge.training.config import (
    CheckpointConfig,
    MockGPTDatasetConfig,
    TrainingConfig,
    ValidationConfig,
    runtime_config_update,
)
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain
from megatron_bridge.training.tokenizers.config import TokenizerConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU lane needs a CUDA GPU")

FP32_LOGITS_TOLERANCE = 1e-4
"""Largest |ours - transformers'| logit difference accepted for fp32 weights (ours on the GPU,
transformers on the CPU: different kernels; these tiny models' logits are of order 1)."""

RESUME_TOLERANCE = 1e-6
"""Largest loss difference between a resumed run and an uninterrupted one (fp32): CUDA kernels
that reduce with atomics (the embedding backward) may round differently from run to run."""

PEAK_MEMORY_TOLERANCE = 0.15
"""Accepted |measured / planned - 1| for the peak memory of `planner_config()` on the GPU
(`torch.cuda.max_memory_allocated` against the planner's estimate without its fixed workspace
allowance). The model state (about 70% of this plan) is exact (tests/test_planner.py), each
local-layer tensor kept for backward is one of the planner's (tests/test_planner_activations.py),
and the bench config's measured peak is 1.06x its plan; the margin covers what only a GPU
allocates (cuBLAS workspaces, the kernels' own buffers) and allocator rounding."""


# ---------------------------------------------------------------------- configs (also checked on CPU)
def training_config(precision=None, iters=20, **checkpoint):
    """A tiny GPT on mock data; `precision` is a mixed-precision preset (None: fp32)."""
    cfg = tiny_config(
        train=TrainingConfig(train_iters=iters, global_batch_size=8, micro_batch_size=2),
        model=tiny_model(hidden_dropout=0.1, attention_dropout=0.1),
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
        checkpoint=CheckpointConfig(**checkpoint),
        mixed_precision=precision,
    )
    cfg.logger.log_interval = 1
    cfg.rng.seed = 1234
    return cfg


def lora_config(pretrained, iters=10):
    from megatron_bridge.peft import LoRA

    cfg = tiny_config(
        train=TrainingConfig(train_iters=iters, global_batch_size=8, micro_batch_size=2),
        model=tiny_llama_model(),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        checkpoint=CheckpointConfig(pretrained_checkpoint=pretrained),
    )
    cfg.peft = LoRA(dim=8, alpha=16)
    return cfg


def planner_config():
    """Large enough that model state and activations, not allocator granularity, make the peak."""
    cfg = tiny_config(
        train=TrainingConfig(train_iters=3, global_batch_size=4, micro_batch_size=2),
        model=tiny_model(
            num_layers=4, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096, seq_length=1024,
            vocab_size=32000, make_vocab_size_divisible_by=128,
        ),  # fmt: skip
        dataset=MockGPTDatasetConfig(seq_length=1024, num_workers=0),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=32000),
        validation=ValidationConfig(eval_iters=0),
        mixed_precision="bf16_mixed",
    )
    cfg.ddp.use_distributed_optimizer = True
    return cfg


class Observe(Callback):
    """Losses, and what the run trains with: backend, device and dtype of the weights."""

    def __init__(self, snapshot_at=None):
        self.losses, self.snapshot_at = [], snapshot_at
        self.snapshot = self.start = self.end = None

    @staticmethod
    def weights(state):
        return {n: p.detach().float().cpu().clone() for n, p in state.model[0].named_parameters()}

    def on_train_start(self, state):
        p = next(state.model[0].parameters())
        self.backend, self.device, self.dtype = torch.distributed.get_backend(), p.device.type, p.dtype
        self.start = self.weights(state)

    def on_step_end(self, state, metrics):
        if "lm loss" in metrics:
            self.losses.append(metrics["lm loss"])
        if state.train_state.step == self.snapshot_at:
            self.snapshot = self.weights(state)

    def on_train_end(self, state):
        self.end = self.weights(state)


# ---------------------------------------------------------------------- the lane
@pytest.mark.parametrize("precision, dtype", [(None, torch.float32), ("bf16_mixed", torch.bfloat16)], ids=["fp32", "bf16"])
@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(600)
def test_training_on_cuda_with_nccl(precision, dtype):
    seen = Observe()
    state = pretrain(training_config(precision), forward_step, callbacks=[seen])
    assert (seen.backend, seen.device, seen.dtype) == ("nccl", "cuda", dtype)
    assert state.train_state.step == 20 and len(seen.losses) == 20
    assert all(torch.isfinite(torch.tensor(seen.losses)))
    assert sum(seen.losses[-4:]) / 4 < sum(seen.losses[:4]) / 4 - 0.5  # it learns


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(600)
def test_checkpoint_saved_on_the_gpu_resumes_exactly(tmp_path):
    """Saved from the GPU at iteration 5 (weights, optimizer, CUDA RNG states, with dropout on),
    loaded back onto the GPU: the weights are those of iteration 5 bit for bit, and training goes
    on as the uninterrupted run did."""
    ckpt = str(tmp_path / "ckpt")
    straight = Observe(snapshot_at=5)
    pretrain(training_config(iters=10, save=ckpt, save_interval=5), forward_step, callbacks=[straight])
    resumed = Observe()
    state = pretrain(training_config(iters=10, load=ckpt, ckpt_step=5), forward_step, callbacks=[resumed])
    assert state.train_state.step == 10 and resumed.device == "cuda"
    for name, value in straight.snapshot.items():
        assert torch.equal(resumed.start[name], value), name
    assert len(resumed.losses) == 5
    assert max(abs(a - b) for a, b in zip(resumed.losses, straight.losses[5:])) <= RESUME_TOLERANCE


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(600)
def test_hf_import_onto_the_gpu_matches_transformers(tmp_path):
    from hf_models import family_configs, hf_logits, megatron_logits, random_tokens, save_tiny

    from megatron_bridge.models.hf.convert import import_hf

    source = save_tiny("llama", str(tmp_path / "hf"))
    vocab = family_configs()["llama"].vocab_size
    tokens = random_tokens(vocab)
    reference = hf_logits(source, tokens)
    torch.cuda.reset_peak_memory_stats()
    import_hf(source, str(tmp_path / "ckpt"), backend="nccl")  # built, loaded and saved on the GPU
    assert torch.cuda.max_memory_allocated() > 0
    for loaded in (source, str(tmp_path / "ckpt")):  # read onto the GPU directly, and through our checkpoint
        ours = megatron_logits(loaded, tokens.cuda(), backend="nccl")
        assert (ours[..., :vocab] - reference).abs().max().item() < FP32_LOGITS_TOLERANCE, loaded


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(600)
def test_lora_on_the_gpu_trains_the_adapters_only(tmp_path):
    from megatron_bridge.training.finetune import finetune

    base = str(tmp_path / "base")
    base_cfg = lora_config(None)
    base_cfg.peft, base_cfg.checkpoint.pretrained_checkpoint, base_cfg.checkpoint.save = None, None, base
    pretrain(base_cfg, forward_step)
    seen = Observe()
    finetune(lora_config(base), forward_step, callbacks=[seen])
    assert (seen.backend, seen.device) == ("nccl", "cuda")
    assert len(seen.losses) == 10 and all(torch.isfinite(torch.tensor(seen.losses)))
    changed = {n for n in seen.start if not torch.equal(seen.start[n], seen.end[n])}
    adapters = {n for n in seen.start if "lora_" in n}
    assert adapters and changed == adapters  # the base weights stay frozen


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(600)
def test_planner_peak_memory_against_the_gpu():
    from megatron_bridge.planning import plan

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cfg = planner_config()
    pretrain(cfg, forward_step)
    measured = torch.cuda.max_memory_allocated() - before
    worst = plan(cfg, with_fixes=False).worst
    planned = worst.total - worst.workspace
    ratio = measured / planned
    message = f"measured {measured / 2**20:.0f} MiB, planned {planned / 2**20:.0f} MiB: ratio {ratio:.3f}"
    print(message)
    assert abs(ratio - 1) <= PEAK_MEMORY_TOLERANCE, message


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(600)
def test_a_run_larger_than_the_gpu_is_refused_before_anything_is_written(tmp_path):
    from megatron_bridge.config.errors import ConfigValidationError

    cfg = training_config(save=str(tmp_path / "ckpt"))
    cfg.train.micro_batch_size = cfg.train.global_batch_size = 10_000_000
    with pytest.raises(ConfigValidationError, match=r"GiB of GPU memory per process \(parameters .* of its GPU \("):
        pretrain(cfg, forward_step)
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------------- on every machine
def test_gpu_lane_configs_resolve_and_plan_on_any_machine(tmp_path):
    """What the lane trains is a valid config here too, and the planner plans the memory test's."""
    from megatron_bridge.planning import plan

    for cfg in (training_config(), training_config("bf16_mixed"), lora_config(str(tmp_path)), planner_config()):
        runtime_config_update(cfg, world_size=1)
    cfg = planner_config()
    runtime_config_update(cfg, world_size=1)
    worst = plan(cfg, with_fixes=False).worst
    assert worst.total - worst.workspace > 1e9  # model state and activations make the peak, not allocator rounding
    assert worst.activations.total > 0.2 * (worst.total - worst.workspace)
