"""LoRA and DoRA on CPU: config, step-0 identity, frozen base, adapter-only checkpoints, exact
resume, merge, and adapters that the `peft` library reads onto a transformers Llama."""

import json
import logging
import os

import pytest
import torch
from factories import on_cpu, tiny_config, tiny_llama_model, tiny_model
from hf_llama import llama_from_megatron

from megatron_bridge.cli.main import main as mbridge
from megatron_bridge.peft import DoRA, LoRA
from megatron_bridge.peft.apply import adapters, base_weights_loaded, is_adapter_key, merge_and_unwrap
from megatron_bridge.peft.export import read_adapter_tensors
from megatron_bridge.peft.merge import read_adapter_checkpoint
from megatron_bridge.peft.offline import load_weights, single_process_model
from megatron_bridge.training.callbacks import Callback
from megatron_bridge.runtime.checkpointing import layout
from megatron_bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    ConfigValidationError,
    TrainingConfig,
    ValidationConfig,
)
from megatron_bridge.training.finetune import finetune
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain
from megatron_bridge.config.overrides import process_config_with_overrides

pytestmark = pytest.mark.timeout(300)

TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def config(iters=10, peft=None, pretrained=None, save=None, load=None, exit_interval=None):
    cfg = tiny_config(
        train=TrainingConfig(train_iters=iters, global_batch_size=8, micro_batch_size=2, exit_interval=exit_interval),
        model=tiny_llama_model(),
        validation=ValidationConfig(eval_interval=None, eval_iters=1),
        checkpoint=CheckpointConfig(pretrained_checkpoint=pretrained, save=save, load=load),
    )
    cfg.peft = peft
    return cfg


def on_model(model):
    """TOKENS and their positions on the device of `model`."""
    device = next(model.parameters()).device
    return TOKENS.to(device), torch.arange(TOKENS.shape[1], device=device).expand_as(TOKENS)


def logits(model):
    """fp32 logits of `model` for TOKENS, as a CPU tensor."""
    with torch.no_grad():
        return model(*on_model(model), None).float().cpu()


class Record(Callback):
    """Losses; the base weights and the adapters at the start and end; what the optimizer holds."""

    def __init__(self):
        self.losses, self.start, self.end, self.optimized = [], {}, {}, set()

    @staticmethod
    def weights(state):
        return {n: p.detach().clone() for n, p in state.model[0].module.named_parameters()}

    def on_train_start(self, state):
        self.start = self.weights(state)

    def on_step_end(self, state, metrics):
        self.losses.append(metrics["lm loss"])

    def on_train_end(self, state):
        self.end = self.weights(state)
        names = {id(p): n for n, p in state.model[0].module.named_parameters()}
        for opt in state.optimizer.chained_optimizers:
            for group in opt.optimizer.param_groups:
                self.optimized.update(names[id(p)] for p in group["params"])
        self.states = [s for opt in state.optimizer.chained_optimizers for s in opt.optimizer.state.values()]


def train(cfg, entry=finetune):
    record = Record()
    state = entry(cfg, forward_step, callbacks=[record])
    return record, state


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A briefly pretrained tiny Llama-style model: the base the adapters train on."""
    path = str(tmp_path_factory.mktemp("base") / "ckpt")
    train(config(save=path), entry=pretrain)
    return path


@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lora") / "ckpt")
    # on CPU on every machine: test_resume_is_exact compares its losses bit for bit
    record, _ = train(on_cpu(config(iters=20, peft=LoRA(dim=8, alpha=16, dropout=0.1), pretrained=base, save=path)))
    return path, record


@pytest.fixture(scope="module")
def dora_run(base, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dora") / "ckpt")
    record, _ = train(config(peft=DoRA(dim=8, alpha=16), pretrained=base, save=path))
    return path, record


# ---------------------------------------------------------------------- config
def test_peft_from_overrides_and_yaml_round_trip(tmp_path):
    cfg = config()
    process_config_with_overrides(
        cfg,
        cli_overrides=[
            "peft=lora",
            "peft.dim=16",
            "peft.alpha=32",
            "peft.target_modules=[linear_qkv,'*.layers.1.*.linear_fc2']",
        ],
    )
    assert type(cfg.peft) is LoRA and cfg.peft.dim == 16 and cfg.peft.scale == 2.0
    assert cfg.peft.target_modules == ["linear_qkv", "*.layers.1.*.linear_fc2"]
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    assert ConfigContainer.from_yaml(path).peft == cfg.peft
    process_config_with_overrides(cfg, cli_overrides=["peft=dora"])
    assert type(cfg.peft) is DoRA and cfg.peft.dim == 32  # a fresh DoRA with its defaults
    cfg.to_yaml(path)
    assert type(ConfigContainer.from_yaml(path).peft) is DoRA


def test_override_errors_name_the_choices():
    with pytest.raises(
        ConfigValidationError, match=r"peft: is null, so it has no key 'dim'.*choose one first: peft=lora or peft=dora"
    ):
        process_config_with_overrides(config(), cli_overrides=["peft.dim=8"])
    with pytest.raises(
        ConfigValidationError, match=r"expected 'lora' or 'dora' or a mapping, got str 'lorra'.*did you mean 'lora'"
    ):
        process_config_with_overrides(config(), cli_overrides=["peft=lorra"])


def test_help_config_lists_the_peft_fields(capsys):
    assert mbridge(["finetune", "--recipe", "tiny_gpt_lora_finetune_config", "--help-config", "peft"]) == 0
    out = capsys.readouterr().out
    assert "peft (LoRA)" in out and "dim: int = 16" in out and "Rank of the update" in out
    assert mbridge(["finetune", "--recipe", "tiny_gpt_finetune_config", "--help-config", "peft"]) == 0
    assert "peft=lora or peft=dora creates one" in capsys.readouterr().out


def test_bad_peft_configs_are_reported_together(tmp_path):
    cfg = config(peft=LoRA(dim=0, alpha=0))
    with pytest.raises(ConfigValidationError) as err:
        cfg.validate()
    text = str(err.value)
    assert "peft.dim: the rank must be positive, got 0" in text
    assert "peft.alpha: must be positive, got 0" in text
    assert (
        "checkpoint.pretrained_checkpoint: LoRA trains adapters on top of pretrained weights, and none are given"
        in text
    )


def test_unknown_target_lists_the_valid_names(tmp_path):
    cfg = config(peft=LoRA(target_modules=["linear_qkv", "linear_qvk", "*.layers.7.*"]), pretrained=str(tmp_path))
    with pytest.raises(ConfigValidationError) as err:
        cfg.validate()
    assert len(err.value.errors) == 2
    assert (
        "peft.target_modules.1: 'linear_qvk' matches no module of this model (valid names: linear_qkv, linear_proj, linear_fc1, linear_fc2;"
        in err.value.errors[0]
    )
    assert "decoder.layers.0.self_attention.linear_qkv" in err.value.errors[0]
    assert err.value.errors[1].startswith("peft.target_modules.2: '*.layers.7.*' matches no module")


def test_grouped_gemm_experts_cannot_take_dora(tmp_path):
    moe = tiny_model(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True)
    cfg = tiny_config(model=moe, checkpoint=CheckpointConfig(pretrained_checkpoint=str(tmp_path)))
    cfg.peft = DoRA(target_modules=["*.experts.*.linear_fc1"])
    with pytest.raises(
        ConfigValidationError,
        match=r"peft.target_modules: DoRA cannot wrap grouped-GEMM experts .*set model.moe_grouped_gemm=False",
    ):
        cfg.validate()
    cfg.peft = DoRA(target_modules=["linear_qkv"])  # attention only: fine
    cfg.validate()


# ---------------------------------------------------------------------- the adapted model
@pytest.mark.parametrize("method", [LoRA, DoRA])
def test_step_zero_output_is_the_base_output(base, method):
    cfg = config(peft=method(dim=8), pretrained=base)
    with single_process_model(cfg, with_adapters=False) as plain:
        load_weights(plain, base)
        expected = logits(plain)
    with single_process_model(cfg) as adapted:
        load_weights(adapted, base, "base")
        base_weights_loaded(adapted)
        assert len(list(adapters(adapted))) == 8 and all(a.lora_A.abs().sum() > 0 for a in adapters(adapted))
        assert torch.equal(logits(adapted), expected)  # B = 0 (DoRA: magnitude = row norms): exactly the base


def test_moe_expert_adapters_start_as_the_base_and_train(monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.1's router names te_general_gemm, defined only when TransformerEngine is installed
    monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    moe = tiny_model(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, hidden_dropout=0.0)
    cfg = tiny_config(model=moe)
    cfg.peft = LoRA(dim=4, target_modules=["*.experts.*.linear_fc1", "*.experts.*.linear_fc2"])
    with single_process_model(cfg, with_adapters=False) as plain:
        expected = logits(plain)
    with single_process_model(cfg) as adapted:
        names = [n for n, p in adapted.named_parameters() if p.requires_grad]
        assert len(names) == 2 * 2 * 4 * 2 and all(
            ".local_experts." in n for n in names
        )  # layers x fc x experts x (A, B)
        assert torch.equal(logits(adapted), expected)
        tokens, positions = on_model(adapted)
        adapted(tokens, positions, None, labels=tokens).mean().backward()
        assert all(p.grad is not None for n, p in adapted.named_parameters() if n.endswith("lora_B"))


# ---------------------------------------------------------------------- training and checkpoints
def test_training_moves_only_the_adapters(lora_run):
    _, record = lora_run
    moved = [n for n in record.start if not torch.equal(record.start[n], record.end[n])]
    assert moved and all(is_adapter_key(n) for n in moved)  # every base weight is bit-identical
    assert {n for n in moved if n.endswith("lora_B")} == {n for n in record.start if n.endswith("lora_B")}
    trainable = {n for n in record.start if is_adapter_key(n)}
    assert record.optimized == trainable  # the optimizer holds the adapters, and only them
    assert sum(s["exp_avg"].numel() for s in record.states) == sum(record.start[n].numel() for n in trainable)


def test_trainable_count_is_logged(base, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        train(config(iters=1, peft=LoRA(dim=8), pretrained=base))
    # 2 layers x (qkv 8x64 + 128x8, proj 8x64 + 64x8, fc1 8x64 + 256x8, fc2 8x128 + 64x8)
    assert (
        "LoRA: 13312 trainable parameters of 120128 on this rank (11.082%); the base weights are frozen" in caplog.text
    )
    assert "loaded base weights of iteration 10" in caplog.text


def test_checkpoint_holds_the_adapters_and_records_the_base(lora_run, base):
    path, _ = lora_run
    directory, iteration, _, common = read_adapter_checkpoint(path)
    assert iteration == 20 and common["peft"]["method"] == "LoRA"
    assert common["peft"]["pretrained_checkpoint"] == base
    assert common["peft"]["pretrained_iteration_dir"] == layout.iteration_dir(base, 10)
    import torch.distributed.checkpoint as dcp

    keys = [
        k
        for k in dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
        if not k.startswith(("optimizer.", "rng_state"))
    ]
    assert keys and all(is_adapter_key(k) for k in keys)
    tensors = read_adapter_tensors(directory)
    assert tensors["decoder.layers.0.mlp.linear_fc1.lora_B"].shape == (256, 8)  # whole, gate rows then up rows


def test_resume_is_exact(lora_run, base, tmp_path, caplog):
    _, straight = lora_run  # 20 iterations with adapter dropout: resuming must restore the RNG streams too
    path = str(tmp_path / "ckpt")
    peft = LoRA(dim=8, alpha=16, dropout=0.1)
    # bit for bit on CPU (some CUDA kernels reduce in a varying order; the GPU lane resumes on the GPU)
    first, state = train(on_cpu(config(iters=20, peft=peft, pretrained=base, save=path, exit_interval=10)))
    assert state.train_state.step == 10
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        second, state = train(on_cpu(config(iters=20, peft=peft, pretrained=base, save=path, load=path)))
    assert (
        "loaded base weights of iteration 10" in caplog.text and "resumed from adapters of iteration 10" in caplog.text
    )
    assert first.losses + second.losses == straight.losses


def test_adapter_checkpoints_are_not_bases_and_bases_are_not_resumed(lora_run, base):
    path, _ = lora_run
    cfg = config(iters=1, peft=LoRA(), pretrained=path, load=base)
    with pytest.raises(ConfigValidationError) as err:
        cfg.validate()  # before anything is built
    assert err.value.errors == [
        f"checkpoint.pretrained_checkpoint: {path!r} holds the adapters of a PEFT run, not base weights (point it at "
        "the base model's checkpoint, or fold the adapters in first (mbridge peft merge))",
        f"checkpoint.load: {base!r} holds a checkpoint without adapters; a LoRA run resumes only from its own adapter "
        "checkpoints (set checkpoint.load to this run's save directory (or a new one); the base goes in pretrained_checkpoint)",
    ]


def test_resuming_other_adapters_is_refused_before_anything_is_built(lora_run, base):
    path, _ = lora_run  # LoRA rank 8 on the four projections
    where = f"the adapters in {path!r} (iteration directory iter_0000020)"
    fix = "train new adapters in another run directory (--name NEW, or checkpoint.save and checkpoint.load elsewhere)"
    cfg = config(iters=30, peft=LoRA(dim=4, target_modules=["linear_qkv"]), pretrained=base, load=path)
    with pytest.raises(ConfigValidationError) as err:
        cfg.validate()
    assert err.value.errors == [
        f"peft.dim: 4, but {where} have rank 8 (set peft.dim=8 to resume them, or {fix})",
        f"peft.target_modules: ['linear_qkv'], but {where} were trained on ['linear_qkv', 'linear_proj', 'linear_fc1', "
        f"'linear_fc2'] (set peft.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2] to resume them, or {fix})",
    ]
    with pytest.raises(ConfigValidationError) as err:
        config(iters=30, peft=DoRA(dim=8), pretrained=base, load=path).validate()
    assert err.value.errors == [f"peft: DoRA, but {where} are LoRA (set peft=lora to resume them, or {fix})"]
    # other patterns for the same modules, another alpha and dropout: the same adapters, resumable
    same = LoRA(dim=8, alpha=4, target_modules=["*.linear_qkv", "*.self_attention.linear_proj", "linear_fc1", "linear_fc2"])
    config(iters=30, peft=same, pretrained=base, load=path).validate()


def test_dora_trains_its_magnitude(dora_run):
    _, record = dora_run
    magnitudes = [n for n in record.start if n.endswith("lora_magnitude")]
    assert len(magnitudes) == 8 and all(not torch.equal(record.start[n], record.end[n]) for n in magnitudes)
    assert all(is_adapter_key(n) for n in record.start if not torch.equal(record.start[n], record.end[n]))


# ---------------------------------------------------------------------- merge and export
def test_a_base_of_another_architecture_is_refused_by_each_command(lora_run, tmp_path):
    """`--base` names the weights the adapters go on: one of another shape (here a Llama with
    another MLP width) is a usage error naming the fields, before any model is built."""
    import subprocess
    import sys

    from factories import source_tree_env
    from hf_models import save_tiny

    path, _ = lora_run
    other = save_tiny("llama", str(tmp_path / "other_llama"))
    expected = (
        f"--base {other!r} holds a LlamaModelProvider (2 layers, hidden size 64, 4 attention heads), but the adapters "
        "were trained on a GPTModelProvider (2 layers, hidden size 64, 4 attention heads) (ffn_hidden_size: base 96, "
        "adapters 128); give the base they were trained on, or leave it out to use the one they record"
    )
    argv = ["peft", "merge", path, str(tmp_path / "merged"), "--base", other]
    proc = subprocess.run([sys.executable, "-m", "megatron_bridge", *argv], env=source_tree_env(),
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == f"mbridge peft merge: error: {expected}", proc.stderr[-3000:]
    assert not (tmp_path / "merged").exists()
    # generate and eval resolve their source this way (a SourceError is their usage error, exit 2)
    from megatron_bridge.inference.errors import SourceError
    from megatron_bridge.inference.sources import resolve

    with pytest.raises(SourceError) as err:
        resolve(path, base=other)
    assert str(err.value) == expected


def test_adapters_whose_base_is_gone_name_the_flag_that_gives_it(base, tmp_path):
    """`peft merge` of adapters whose recorded base was moved away said to give the base's
    directory "explicitly", without naming `--base`."""
    import shutil
    import subprocess
    import sys

    from factories import source_tree_env

    moved = shutil.copytree(base, tmp_path / "base")
    path = str(tmp_path / "adapters")
    train(on_cpu(config(iters=2, peft=LoRA(dim=8, alpha=16), pretrained=str(moved), save=path)))
    shutil.rmtree(moved)
    argv = ["peft", "merge", path, str(tmp_path / "merged")]
    proc = subprocess.run([sys.executable, "-m", "megatron_bridge", *argv], env=source_tree_env(),
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"the base weights of these adapters ('{moved}/iter_0000010') are not there; give their directory with " \
        "--base DIR" in proc.stderr  # fmt: skip
    assert not (tmp_path / "merged").exists()


def test_merge_keeps_what_it_did_not_write(lora_run, tmp_path):
    """A merge into the adapters' own save directory, or one holding files of the user's, is
    refused before anything loads (it replaced the adapter checkpoint, or hid other iterations
    behind its tracker); the directories are left as they were."""
    from megatron_bridge.peft.merge import merge_checkpoint

    path, _ = lora_run
    before = sorted(os.listdir(path))
    with pytest.raises(ConfigValidationError, match="holds the adapters being merged, which the merge would replace"):
        merge_checkpoint(path, path)
    occupied = tmp_path / "occupied"
    (occupied / "iter_0000005").mkdir(parents=True)
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(ConfigValidationError) as caught:
        merge_checkpoint(path, str(occupied))
    assert str(caught.value).endswith(
        f"{occupied}: holds iter_0000005/, notes.txt, which a merge does not write (give a new or empty directory: "
        "a merge there would make its iteration 20 the latest)"
    )
    assert sorted(os.listdir(path)) == before and sorted(os.listdir(occupied)) == ["iter_0000005", "notes.txt"]


@pytest.mark.parametrize("run", ["lora_run", "dora_run"])
def test_merged_and_hf_peft_logits_match(run, base, tmp_path, request):
    path, _ = request.getfixturevalue(run)
    directory, _, cfg, _ = read_adapter_checkpoint(path)
    with single_process_model(cfg) as model:
        load_weights(model, base, "base")
        load_weights(model, directory, "adapters")
        adapted = logits(model)
        assert merge_and_unwrap(model) == 8
        merged_in_memory = logits(model)
    assert (merged_in_memory - adapted).abs().max() < 1e-5

    # mbridge peft merge: a full checkpoint that loads as the weights of a plain model
    assert mbridge(["peft", "merge", path, str(tmp_path / "merged")]) == 0
    with single_process_model(cfg, with_adapters=False) as plain:
        load_weights(plain, str(tmp_path / "merged"))
        assert (logits(plain) - adapted).abs().max() < 1e-5

    # mbridge peft export: the peft library loads the adapters onto the HF model of the base
    import peft

    assert mbridge(["peft", "export", path, str(tmp_path / "hf")]) == 0
    adapter_config = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())
    assert adapter_config["target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert (
        adapter_config["use_dora"] == (run == "dora_run")
        and adapter_config["r"] == 8
        and adapter_config["lora_alpha"] == 16
    )
    hf_base = llama_from_megatron(layout.iteration_dir(base, 10), cfg.model)
    hf = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "hf")).eval()
    with torch.no_grad():
        theirs = hf(TOKENS).logits
    assert (theirs - adapted).abs().max() < 1e-4
    assert adapter_config["base_model_name_or_path"] == base  # no Hugging Face origin: our base checkpoint

    # mbridge hf export: the adapters folded into a Hugging Face model (config.json written here)
    from transformers import AutoModelForCausalLM

    assert mbridge(["hf", "export", path, str(tmp_path / "folded")]) == 0
    folded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "folded"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (folded(TOKENS).logits - adapted).abs().max() < 1e-4


def test_export_splits_fused_projections_and_refuses_experts():
    from megatron_bridge.peft.export import to_peft_state
    from megatron_bridge.peft.hf_names import UnmappedModuleError

    model = tiny_llama_model()  # 4 heads in 2 query groups of 16 channels: per group 2 q heads, k, v
    rows = torch.arange(128.0).unsqueeze(1)
    state = to_peft_state(
        {
            "decoder.layers.1.self_attention.linear_qkv.lora_B": rows,
            "decoder.layers.1.mlp.linear_fc1.lora_magnitude": torch.arange(256.0),
        },
        model,
    )
    prefix = "base_model.model.model.layers.1."
    assert state[prefix + "self_attn.q_proj.lora_B.weight"][:, 0].tolist() == [*range(32), *range(64, 96)]
    assert state[prefix + "self_attn.k_proj.lora_B.weight"][:, 0].tolist() == [*range(32, 48), *range(96, 112)]
    assert state[prefix + "self_attn.v_proj.lora_B.weight"][:, 0].tolist() == [*range(48, 64), *range(112, 128)]
    assert state[prefix + "mlp.gate_proj.lora_magnitude_vector"].tolist() == list(range(128))
    assert state[prefix + "mlp.up_proj.lora_magnitude_vector"].tolist() == list(range(128, 256))
    with pytest.raises(UnmappedModuleError, match="adapters on MoE experts have no peft-format counterpart"):
        to_peft_state({"decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.lora_A": torch.zeros(2, 2)}, model)
