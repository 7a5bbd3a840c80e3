"""LoRA and DoRA on a Hugging Face model: trained from its directory (`pretrained=<HF dir>`),
written back at the end (`save_hf`: folded in, and as a peft adapter), exported from the
checkpoint by `mbridge peft export` and `mbridge hf export`, and loaded by transformers and peft
with our logits. Also: a checkpoint of another architecture is refused before anything is built."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from factories import REPO, backend_for, on_cpu, source_tree_env, tiny_config, torchrun
from hf_models import save_tiny

from megatron_bridge.cli.main import main as mbridge
from megatron_bridge.models import GPTModelProvider
from megatron_bridge.peft import DoRA, LoRA
from megatron_bridge.peft.export import hf_base_model
from megatron_bridge.peft.merge import read_adapter_checkpoint
from megatron_bridge.peft.offline import load_weights, single_process_model
from megatron_bridge.training.callbacks import Callback
from megatron_bridge.training.config import CheckpointConfig, ConfigValidationError, TrainingConfig, ValidationConfig
from megatron_bridge.training.finetune import finetune
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.tokenizers.config import TokenizerConfig

pytestmark = pytest.mark.timeout(400)

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
PEFT_ATOL = 1e-4  # fp32 throughout; the peft library computes the adapter path on its own


def config(source, save, peft, iters=4, load=None, exit_interval=None, save_hf=False):
    model = GPTModelProvider.from_hf(source)
    model.seq_length = 32
    return tiny_config(
        model=model,
        train=TrainingConfig(train_iters=iters, global_batch_size=4, micro_batch_size=2, exit_interval=exit_interval),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=255),  # ids (and EOD) < 256
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
        checkpoint=CheckpointConfig(pretrained_checkpoint=source, save=save, load=load, save_hf=save_hf),
        peft=peft,
    )


class Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_step_end(self, state, metrics):
        self.losses.append(metrics["lm loss"])


def train(cfg):
    record = Losses()
    state = finetune(cfg, forward_step, callbacks=[record])
    return record.losses, state


def fresh_process(*argv, timeout=240):
    return subprocess.run([sys.executable, "-m", "megatron_bridge", *argv], cwd=REPO, env=source_tree_env(),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def model_logits(model, tokens=TOKENS):
    """Logits of a transformers/peft model, or of our megatron-core model, on the CPU."""
    with torch.no_grad():
        if hasattr(model, "config") and hasattr(model.config, "model_type"):
            return model(tokens.to(model.device)).logits.float().cpu()
        device = next(model.parameters()).device
        tokens = tokens.to(device)
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        return model(tokens, positions, None).float().cpu()


def ours(checkpoint, base):
    """Our logits: the adapted megatron-core model with the base weights of `base` and the
    adapters of `checkpoint`."""
    directory, _, cfg, _ = read_adapter_checkpoint(checkpoint)
    with single_process_model(cfg) as model:
        load_weights(model, base, "base")
        load_weights(model, directory, "adapters")
        return model_logits(model)


def hf_model(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny("llama", str(tmp_path_factory.mktemp("hf") / "tiny-llama"))


@pytest.fixture(scope="module")
def lora_run(source, tmp_path_factory):
    """4 LoRA iterations on the Hugging Face weights, written back with `save_hf`."""
    save = str(tmp_path_factory.mktemp("lora") / "ckpt")
    losses, state = train(config(source, save, LoRA(dim=8, alpha=16), save_hf=True))
    assert state.train_state.step == 4 and len(losses) == 4
    return save


# ---------------------------------------------------------------------- LoRA from a Hugging Face directory
def test_lora_from_hf_trains_the_adapters_and_records_the_base(lora_run, source):
    _, iteration, cfg, common = read_adapter_checkpoint(lora_run)
    assert iteration == 4 and cfg.peft.dim == 8
    assert common["peft"]["pretrained_iteration_dir"] == os.path.abspath(source)
    assert hf_base_model(lora_run) == os.path.abspath(source)
    before = model_logits(hf_model(source))
    assert (ours(lora_run, source) - before).abs().max() > 1e-3  # the adapters moved (B was zero)


def test_peft_export_loads_onto_the_hf_model_with_our_logits(lora_run, source, tmp_path):
    import peft

    expected = ours(lora_run, source)
    out = str(tmp_path / "adapter")
    proc = fresh_process("peft", "export", lora_run, out)
    assert proc.returncode == 0, proc.stderr
    adapter_config = json.loads(open(os.path.join(out, "adapter_config.json")).read())
    assert adapter_config["base_model_name_or_path"] == os.path.abspath(source)
    loaded = peft.PeftModel.from_pretrained(hf_model(source), out).eval()
    assert (model_logits(loaded) - expected).abs().max() < PEFT_ATOL
    # the recorded base is the Hugging Face directory: peft finds and loads it by itself
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (model_logits(auto) - expected).abs().max() < PEFT_ATOL


def test_save_hf_writes_the_folded_model_and_the_adapter(lora_run, source):
    import peft

    expected = ours(lora_run, source)
    merged, adapter = os.path.join(lora_run, "hf_iter_0000004"), os.path.join(lora_run, "hf_iter_0000004_adapter")
    assert not [name for name in os.listdir(lora_run) if name.endswith(".incomplete")]
    assert {"config.json", "model.safetensors"} <= set(os.listdir(merged))
    assert (model_logits(hf_model(merged)) - expected).abs().max() < PEFT_ATOL
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = peft.PeftModel.from_pretrained(hf_model(source), adapter).eval()
    assert (model_logits(loaded) - expected).abs().max() < PEFT_ATOL


def test_hf_export_of_a_lora_checkpoint_folds_the_adapters_in(lora_run, source, tmp_path):
    expected = ours(lora_run, source)
    out = str(tmp_path / "exported")
    proc = fresh_process("hf", "export", lora_run, out)
    assert proc.returncode == 0, proc.stderr
    config_json = json.loads(open(os.path.join(out, "config.json")).read())
    assert config_json["dtype"] == config_json["torch_dtype"] == "float32"
    assert (model_logits(hf_model(out)) - expected).abs().max() < PEFT_ATOL

    proc = fresh_process("hf", "export", lora_run, out, "--base", str(tmp_path / "gone"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "gone" in proc.stderr, proc.stderr


def test_merge_then_base_model_origins(lora_run, source, tmp_path):
    """`mbridge peft merge` folds adapters into Hugging Face base weights; a merged checkpoint has
    no Hugging Face counterpart, an imported one has the directory it came from."""
    expected = ours(lora_run, source)
    merged = str(tmp_path / "merged")
    assert mbridge(["peft", "merge", lora_run, merged]) == 0
    _, _, cfg, _ = read_adapter_checkpoint(lora_run)
    with single_process_model(cfg, with_adapters=False) as plain:
        load_weights(plain, merged)
        assert (model_logits(plain) - expected).abs().max() < 1e-5
    assert hf_base_model(merged) is None
    imported = str(tmp_path / "imported")
    assert mbridge(["hf", "import", source, imported]) == 0
    assert hf_base_model(imported) == os.path.abspath(source)


@pytest.mark.timeout(300)
def test_a_merged_checkpoint_keeps_its_hugging_face_origin_and_exports(lora_run, source, tmp_path):
    expected = ours(lora_run, source)
    merged, out = str(tmp_path / "merged"), str(tmp_path / "exported")
    assert fresh_process("peft", "merge", lora_run, merged).returncode == 0
    assets = os.path.join(merged, "iter_0000004", "hf")
    assert json.load(open(os.path.join(assets, "config.json"))) == json.load(open(os.path.join(source, "config.json")))
    proc = fresh_process("hf", "export", merged, out)
    assert proc.returncode == 0, proc.stderr
    assert (model_logits(hf_model(out)) - expected).abs().max() < PEFT_ATOL


@pytest.fixture(scope="module")
def dora_run(source, tmp_path_factory):
    """4 DoRA iterations on the Hugging Face weights."""
    save = str(tmp_path_factory.mktemp("dora") / "ckpt")
    # on CPU on every machine: test_dora_from_hf_resumes_exactly compares its losses bit for bit
    losses, state = train(on_cpu(config(source, save, DoRA(dim=4, alpha=8))))
    assert state.train_state.step == 4
    return save, losses


def test_dora_from_hf_resumes_exactly(dora_run, source, tmp_path, caplog):
    _, straight = dora_run
    save = str(tmp_path / "ckpt")
    # bit for bit on CPU (some CUDA kernels reduce in a varying order; the GPU lane resumes on the GPU)
    first, state = train(on_cpu(config(source, save, DoRA(dim=4, alpha=8), exit_interval=2)))
    assert state.train_state.step == 2
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        second, state = train(on_cpu(config(source, save, DoRA(dim=4, alpha=8), load=save)))
    assert state.train_state.step == 4
    assert "loaded base weights of the Hugging Face model in" in caplog.text
    assert "resumed from adapters of iteration 2" in caplog.text
    assert first + second == straight


def test_dora_adapters_export_with_our_logits(dora_run, source, tmp_path):
    import peft

    save, _ = dora_run
    expected = ours(save, source)
    assert mbridge(["peft", "export", save, str(tmp_path / "adapter")]) == 0
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["use_dora"] is True
    loaded = peft.PeftModel.from_pretrained(hf_model(source), str(tmp_path / "adapter")).eval()
    assert (model_logits(loaded) - expected).abs().max() < PEFT_ATOL
    assert mbridge(["hf", "export", save, str(tmp_path / "folded")]) == 0  # DoRA: rows rescaled
    assert (model_logits(hf_model(str(tmp_path / "folded"))) - expected).abs().max() < PEFT_ATOL


@pytest.mark.slow
def test_dora_export_split_over_tensor_parallel_ranks(dora_run, tmp_path):
    """Under torchrun with TP 2, each rank folds its part (the row norms of row-parallel layers
    summed over both): the same weights as one process."""
    from test_hf_weights import read_all


    save, _ = dora_run
    single, split = str(tmp_path / "single"), str(tmp_path / "tp2")
    backend = ["--backend", backend_for(2)]  # both on the backend of the larger run
    assert mbridge(["hf", "export", save, single, *backend]) == 0
    cmd = [*torchrun(2), "-m", "megatron_bridge", "hf", "export", save, split, "--tp", "2", *backend]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=source_tree_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = read_all(single), read_all(split)
    assert sorted(one) == sorted(two)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-6


# ---------------------------------------------------------------------- another architecture
def test_a_checkpoint_of_another_architecture_is_refused_before_building(source, tmp_path):
    imported = str(tmp_path / "imported")
    assert mbridge(["hf", "import", source, imported]) == 0  # a tiny Llama checkpoint of ours
    data = tmp_path / "sft"
    data.mkdir()
    (data / "training.jsonl").write_text('{"input": "1 2 3", "output": "4 5"}\n')
    proc = fresh_process(
        "finetune", "--recipe", "llama3_8b_lora_finetune_config", "--dir", str(tmp_path / "runs"), "--dry-run",
        "--recipe-arg", f"pretrained_checkpoint={imported}", "--recipe-arg", f"dataset_root={data}",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "# ---- dry run" not in proc.stdout
    assert (
        f"checkpoint.pretrained_checkpoint: {imported!r} holds a LlamaModelProvider (2 layers, hidden size 64, "
        "4 attention heads), but the config's model is a Llama3ModelProvider8B (32 layers, hidden size 4096, "
        "32 attention heads) (num_layers: checkpoint 2, config 32; hidden_size: checkpoint 64, config 4096;"
    ) in proc.stderr, proc.stderr

    # in a run, the same problem stops it at validation, before the model is built
    cfg = tiny_config(checkpoint=CheckpointConfig(pretrained_checkpoint=imported))
    with pytest.raises(ConfigValidationError, match=r"checkpoint.pretrained_checkpoint: .* holds a LlamaModelProvider"):
        finetune(cfg, forward_step)
