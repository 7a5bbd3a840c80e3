"""Hugging Face weights under torchrun with 2 processes (`factories.backend_for(2)`: gloo on CPU
unless there is a GPU per process): TP=2, PP=2 and EP=2 loads give the logits of one process;
import and export split over ranks stay bit-identical."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from factories import backend_for
from factories import torchrun as torchrun_cmd
from hf_models import family_configs, in_subprocess_env, megatron_logits, random_tokens, save_tiny
from test_hf_weights import assert_bit_identical, read_all


SCRIPT = Path(__file__).parent / "scripts" / "hf_logits.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def torchrun(*args: str, timeout: int = 300) -> str:
    cmd = [*torchrun_cmd(2), *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=in_subprocess_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "name, layout",
    [("qwen2", ["--tp", "2"]), ("llama", ["--pp", "2"]), ("mixtral", ["--ep", "2"]), ("deepseek_v3", ["--ep", "2"])],
    ids=["tp2-padded-vocab", "pp2", "ep2-experts", "ep2-deepseek-expert-groups"],
)
def test_parallel_load_gives_the_logits_of_one_process(tmp_path, monkeypatch, name, layout):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    directory = save_tiny(name, str(tmp_path / name), max_shard_size="100KB")
    vocab = family_configs()[name].vocab_size
    out = tmp_path / "logits.pt"
    backend = backend_for(2)
    torchrun(str(SCRIPT), "--hf", directory, "--vocab", str(vocab), *layout, "--backend", backend, "--out", str(out))
    parallel = torch.load(out)
    single = megatron_logits(directory, random_tokens(vocab), backend=backend)
    assert parallel.shape[:2] == single.shape[:2]
    assert (parallel[..., :vocab] - single[..., :vocab]).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "name, layout",
    [("olmo2", ["--tp", "2"]), ("phi3", ["--tp", "2"]), ("gpt_oss", ["--tp", "2", "--ep", "2"]), ("gemma3", ["--tp", "2"]),
     ("gemma2", ["--tp", "2"]), ("deepseek_v3", ["--tp", "2"])],
    ids=["olmo2-tp2", "phi3-tp2", "gpt_oss-tp2-ep2", "gemma3-tp2", "gemma2-tp2", "deepseek_v3-tp2"],
)
def test_parallel_load_and_import_of_families_with_their_own_layers(tmp_path, monkeypatch, name, layout):
    """OLMo 2 (norms after attention and MLP, qk-norm over whole projections split over TP),
    Phi-3 (fused qkv_proj and gate_up_proj), Gemma 3 (RoPE base per layer type, zero-centered
    norms, scaled embeddings), Gemma 2 (soft-capped scores and logits), GPT-OSS (attention sinks split over TP, experts
    stacked in one tensor per layer; on two processes TP2 for attention and EP2 for the experts,
    megatron-core's expert parallelism across tensor-parallel ranks) and DeepSeek-V3 (MLA: latent
    projections split over TP and gathered, rotary rows permuted per rank; experts split by
    expert TP): the split model gives the
    logits of one process, and the checkpoint imported in that layout exports bit-identical (from
    one process; with EP also from the two ranks, each expert-parallel rank's slices gathered
    into the stacked tensors). For OLMo 2 the same processes also check the qk-norm's gradients
    over two ranks (scripts/projection_norm_tp.py)."""
    from transformers import AutoModelForCausalLM

    from megatron_bridge.cli.main import main

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    directory = save_tiny(name, str(tmp_path / name), max_shard_size="100KB")
    vocab = family_configs()[name].vocab_size
    out, ckpt, exported = tmp_path / "logits.pt", str(tmp_path / "ckpt"), str(tmp_path / "exported")
    check = ["--check-projection-norm"] if name == "olmo2" else []
    export = ["--export-to", str(tmp_path / "exported_parallel")] if "--ep" in layout else []
    backend = backend_for(2)
    output = torchrun(str(SCRIPT), "--hf", directory, "--vocab", str(vocab), *layout, "--backend", backend,
                      "--out", str(out), "--import-to", ckpt, *check, *export)  # fmt: skip
    parallel = torch.load(out)
    single = megatron_logits(directory, random_tokens(vocab), backend=backend)
    assert (parallel[..., :vocab] - single[..., :vocab]).abs().max().item() < 1e-5
    if check:
        assert output.count("input grad") == 4, output[-2000:]  # query and key norms on each rank
    assert main(["hf", "export", ckpt, exported]) == 0
    assert_bit_identical(read_all(directory), read_all(exported))
    if export:
        assert_bit_identical(read_all(directory), read_all(export[1]))
        AutoModelForCausalLM.from_pretrained(export[1])


def test_tensor_parallel_import_and_pipeline_parallel_export_are_exact(tmp_path):
    from transformers import AutoModelForCausalLM

    source = save_tiny("qwen3_moe", str(tmp_path / "hf"), max_shard_size="100KB")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "exported")
    backend = ["--backend", backend_for(2)]
    torchrun("-m", "megatron_bridge", "hf", "import", source, ckpt, "--tp", "2", *backend)
    output = torchrun("-m", "megatron_bridge", "hf", "export", ckpt, out, "--pp", "2", "--max-shard-size", "100KB", *backend)
    assert f"exported {ckpt} -> {out}" in output
    assert_bit_identical(read_all(source), read_all(out))
    AutoModelForCausalLM.from_pretrained(out)
