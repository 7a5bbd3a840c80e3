"""LoRA/DoRA fine-tuning under torchrun with 2 processes (`factories.backend_for(2)`: gloo on CPU
unless there is a GPU per process): TP=2 (also with sequence parallelism), PP=2 and DP=2 with the
distributed optimizer give what one process (on the same backend) gives."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from factories import backend_for, tiny_config, tiny_llama_model, torchrun

from megatron_bridge.peft.export import read_adapter_tensors
from megatron_bridge.runtime.checkpointing import layout
from megatron_bridge.training.config import CheckpointConfig, TrainingConfig, ValidationConfig
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain

SCRIPT = Path(__file__).parent / "scripts" / "train_peft.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run(tmp_path, name, *args, nproc=1, timeout=400):
    out = tmp_path / name
    cmd = [sys.executable, str(SCRIPT)]
    if nproc > 1:
        cmd = [*torchrun(nproc), str(SCRIPT)]  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    proc = subprocess.run([*cmd, *args, "--backend", backend_for(2), "--out", str(out)], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"{name}.rank{r}").read_text()) for r in range(nproc)], proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("base") / "ckpt")
    cfg = tiny_config(
        train=TrainingConfig(train_iters=10, global_batch_size=8, micro_batch_size=2),
        model=tiny_llama_model(),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        checkpoint=CheckpointConfig(save=path),
    )
    cfg.dist.distributed_backend = backend_for(2)  # the runs compared start from weights trained where they run
    pretrain(cfg, forward_step)
    return path


@pytest.fixture(scope="module")
def single(base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    results, _ = run(tmp, "tp1", "--pretrained", base, "--save", str(tmp / "ckpt"))
    return results[0], str(tmp / "ckpt")


def test_lora_tensor_parallel_2_matches_one_process(base, single, tmp_path):
    reference, reference_ckpt = single
    results, output = run(tmp_path, "tp2", "--tp", "2", "--pretrained", base, "--save", str(tmp_path / "ckpt"), nproc=2)
    assert "(TP=2 PP=1 CP=1 DP=1)" in output
    for r in results:
        assert r["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    # the adapters themselves, gathered whole from the checkpoints (B split along the output of
    # column-parallel layers, A along the input of row-parallel ones)
    ours = read_adapter_tensors(layout.iteration_dir(str(tmp_path / "ckpt"), 10))
    theirs = read_adapter_tensors(layout.iteration_dir(reference_ckpt, 10))
    assert ours.keys() == theirs.keys() and len(ours) == 16
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-5
    assert all(theirs[k].abs().max() > 0 for k in theirs)


def test_dora_tensor_and_sequence_parallel_matches_one_process(base, tmp_path):
    # The same layers (with norms that allow sequence parallelism on CPU) in one process...
    reference, _ = run(tmp_path, "dora1", "--method", "dora", "--sp-norms", "--iters", "5", "--pretrained", base)
    # ...and over TP=2 with the sequence split: adapters see the gathered/scattered activations.
    results, _ = run(tmp_path, "dora_sp", "--method", "dora", "--tp", "2", "--sequence-parallel", "--iters", "5", "--pretrained", base, nproc=2)  # fmt: skip
    for r in results:
        assert r["losses"] == pytest.approx(reference[0]["losses"], abs=1e-5)


def test_lora_pipeline_parallel_2_trains_like_one_process(base, single, tmp_path):
    results, output = run(tmp_path, "pp2", "--pp", "2", "--pretrained", base, nproc=2)
    assert "(TP=1 PP=2 CP=1 DP=1)" in output
    assert results[0]["losses"] == []  # the first stage holds no loss
    assert results[1]["losses"] == pytest.approx(single[0]["losses"], abs=1e-5)


def test_lora_data_parallel_2_with_distributed_optimizer(base, single, tmp_path):
    results, output = run(
        tmp_path, "dp2", "--dist-opt", "--pretrained", base, "--save", str(tmp_path / "ckpt"), nproc=2
    )
    assert all(r["dp"] == 2 for r in results)
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert mean == pytest.approx(single[0]["losses"], abs=1e-4)
    # the distributed optimizer's state covers the adapters only: 2 layers x 6656 adapter parameters
    import torch.distributed.checkpoint as dcp

    assert "LoRA: 13312 trainable parameters of 120128 on this rank" in output
    keys = dcp.FileSystemReader(layout.iteration_dir(str(tmp_path / "ckpt"), 10)).read_metadata().state_dict_metadata
    moments = [v.size.numel() for k, v in keys.items() if k.startswith("optimizer.") and k.endswith(".exp_avg")]
    assert moments and sum(moments) == 13312
    adapters = read_adapter_tensors(layout.iteration_dir(str(tmp_path / "ckpt"), 10))
    reference = read_adapter_tensors(layout.iteration_dir(single[1], 10))
    assert max((adapters[k] - reference[k]).abs().max().item() for k in adapters) < 1e-4
