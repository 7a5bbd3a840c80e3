"""Hugging Face weights in and out, in one process: logits against transformers for every
family, exact round trips through `mbridge hf import|export`, and bad inputs caught before any
model is built."""

from __future__ import annotations

import json
import os

import pytest
import torch
from factories import tiny_config
from hf_models import family_configs, hf_logits, megatron_logits, random_tokens, save_tiny

from megatron_bridge.cli.main import main
from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.models import GPTModelProvider
from megatron_bridge.training.config import CheckpointConfig, TrainingConfig, ValidationConfig
from megatron_bridge.training.finetune import finetune
from megatron_bridge.training.gpt_step import forward_step

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def read_all(directory) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def assert_bit_identical(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), name


@pytest.mark.parametrize("name", list(family_configs()))
def test_logits_match_transformers(tmp_path, name):
    directory = save_tiny(name, str(tmp_path / name))
    vocab = family_configs()[name].vocab_size
    tokens = random_tokens(vocab)
    reference = hf_logits(directory, tokens)
    ours = megatron_logits(directory, tokens)
    assert ours.shape[:2] == reference.shape[:2] and ours.shape[-1] >= vocab
    assert reference.std() > 0.5  # the weights move the logits: a wrong mapping could not hide
    assert (ours[..., :vocab] - reference).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["llama_tied", "mixtral", "olmo2", "phi3", "gpt_oss", "gemma3", "gemma2", "deepseek_v3"])
def test_round_trip_through_import_and_export_is_bit_identical(tmp_path, capsys, name):
    from recipes import llama3_8b_finetune_config

    source = save_tiny(name, str(tmp_path / "hf"), max_shard_size="100KB")
    assert os.path.isfile(os.path.join(source, "model.safetensors.index.json"))  # sharded
    open(os.path.join(source, "tokenizer.json"), "w").write('{"stand-in": true}')
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "exported")
    assert main(["hf", "import", source, ckpt]) == 0
    assert "imported" in capsys.readouterr().out
    # the imported checkpoint keeps the tokenizer: fine-tuning from it uses it
    recipe = llama3_8b_finetune_config(pretrained=ckpt, dataset_root=str(tmp_path))
    assert recipe.tokenizer.tokenizer_model == os.path.join(ckpt, "iter_0000000", "hf")
    assert main(["hf", "export", ckpt, out, "--max-shard-size", "150KB"]) == 0
    original, exported = read_all(source), read_all(out)
    assert_bit_identical(original, exported)
    assert open(os.path.join(out, "tokenizer.json")).read() == '{"stand-in": true}'
    if name == "llama_tied":
        assert "lm_head.weight" not in exported  # tied: the embedding carries it, as in the source
    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    assert set(index["weight_map"]) == set(exported) and len(set(index["weight_map"].values())) > 1
    assert json.loads(open(os.path.join(out, "config.json")).read())["architectures"] == json.loads(
        open(os.path.join(source, "config.json")).read()
    )["architectures"]
    tokens = random_tokens(family_configs()[name].vocab_size)
    assert torch.equal(hf_logits(out, tokens), hf_logits(source, tokens))


def test_export_in_another_dtype(tmp_path):
    source = save_tiny("qwen3", str(tmp_path / "hf"))
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "exported")
    assert main(["hf", "import", source, ckpt]) == 0
    assert main(["hf", "export", ckpt, out, "--dtype", "bf16"]) == 0
    original, exported = read_all(source), read_all(out)
    assert sorted(original) == sorted(exported)
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    assert all(torch.equal(exported[k], original[k].to(torch.bfloat16)) for k in original)
    written = json.loads(open(os.path.join(out, "config.json")).read())
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"  # transformers 5's key and the earlier one
    from transformers import AutoConfig

    AutoConfig.from_pretrained(out).save_pretrained(tmp_path / "resaved")  # what the installed transformers writes
    resaved = json.loads((tmp_path / "resaved" / "config.json").read_text())
    keys = {"dtype", "torch_dtype"} & set(resaved)
    assert keys and all(resaved[k] == written[k] for k in keys)


def test_export_and_import_keep_what_they_did_not_write(tmp_path):
    """An export replaces its output directory: one holding anything an export does not write
    (here a file and a folder of the user's) is refused before the model is built, and left as
    it was; an earlier export is replaced; a symbolic link is followed, not replaced. An import
    into a directory holding a checkpoint of other iterations is refused too (its tracker would
    make the imported iteration the latest)."""
    from megatron_bridge.models.hf.convert import export_checkpoint, import_hf

    ckpt = str(tmp_path / "ckpt")
    import_hf(save_tiny("qwen3", str(tmp_path / "hf")), ckpt)
    mine = tmp_path / "mine"
    (mine / "folder").mkdir(parents=True)
    (mine / "thesis.txt").write_text("mine")
    with pytest.raises(ConfigValidationError) as caught:
        export_checkpoint(ckpt, str(mine))
    assert str(caught.value).endswith(
        f"{mine}: holds folder/, thesis.txt, which an export does not write (give a new or empty directory: an export "
        "replaces the whole directory)"
    )
    assert sorted(os.listdir(mine)) == ["folder", "thesis.txt"] and (mine / "thesis.txt").read_text() == "mine"

    target, link = tmp_path / "target", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    export_checkpoint(ckpt, str(link))
    export_checkpoint(ckpt, str(link))  # an earlier export is replaced
    assert link.is_symlink() and sorted(os.listdir(target)) == ["config.json", "generation_config.json", "model.safetensors"]

    trained = tmp_path / "trained"
    (trained / "iter_0000100").mkdir(parents=True)
    (trained / "latest_checkpointed_iteration.txt").write_text("100")
    with pytest.raises(ConfigValidationError, match=r"trained: holds iter_0000100/, which an import does not write"):
        import_hf(str(tmp_path / "hf"), str(trained))
    assert (trained / "latest_checkpointed_iteration.txt").read_text() == "100"


def test_a_model_trained_here_exports_with_a_config_json_of_its_own(tmp_path):
    """A Llama-architecture model pretrained from scratch: config.json is written from the
    provider, and transformers computes the logits our model computes from the checkpoint."""
    from transformers import AutoModelForCausalLM

    from megatron_bridge.models import LlamaModelProvider
    from megatron_bridge.training.pretrain import pretrain

    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "exported")
    model = LlamaModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                               seq_length=32, vocab_size=256, make_vocab_size_divisible_by=128, rotary_base=10000)  # fmt: skip
    cfg = tiny_config(
        model=model,
        train=TrainingConfig(train_iters=3, global_batch_size=4, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        checkpoint=CheckpointConfig(save=ckpt),
    )
    pretrain(cfg, forward_step)
    assert main(["hf", "export", ckpt, out]) == 0
    written = json.loads(open(os.path.join(out, "config.json")).read())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["num_key_value_heads"] == 2
    tokens = random_tokens(256)
    ours = megatron_logits(ckpt, tokens)
    hf = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert (hf(tokens).logits - ours).abs().max().item() < 1e-4


# ---------------------------------------------------------------------- bad input
def _finetune_config(directory: str, tmp_path):
    model = GPTModelProvider.from_hf(directory)
    model.seq_length = 32
    return tiny_config(
        model=model,
        train=TrainingConfig(train_iters=2, global_batch_size=2, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        checkpoint=CheckpointConfig(pretrained_checkpoint=directory),
    )


@pytest.fixture
def no_model_building(monkeypatch):
    """Fail the test if anything builds a model (validation must come first)."""
    import megatron_bridge.training.build as build

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the input was checked")

    monkeypatch.setattr(build, "build_model", refuse)
    monkeypatch.setattr(GPTModelProvider, "provide", refuse)


def _sharded(tmp_path) -> str:
    return save_tiny("llama", str(tmp_path / "hf"), max_shard_size="100KB")


def _index(directory) -> dict:
    return json.loads(open(os.path.join(directory, "model.safetensors.index.json")).read())["weight_map"]


def test_missing_shard_is_reported_before_the_model_is_built(tmp_path, no_model_building):
    directory = _sharded(tmp_path)
    weight_map = _index(directory)
    shard = sorted(set(weight_map.values()))[1]
    first = sorted(t for t, f in weight_map.items() if f == shard)[0]
    os.remove(os.path.join(directory, shard))
    cfg = _finetune_config(directory, tmp_path)
    with pytest.raises(ConfigValidationError) as err:
        finetune(cfg, forward_step)
    assert f"checkpoint.pretrained_checkpoint: shard {shard} is missing (it holds {first!r}" in str(err.value)
    assert not torch.distributed.is_initialized()


def test_truncated_file_is_reported_with_its_tensor(tmp_path, no_model_building):
    from megatron_bridge.models.hf.reader import read_header

    directory = _sharded(tmp_path)
    shard = sorted(set(_index(directory).values()))[-1]
    path = os.path.join(directory, shard)
    header = read_header(path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    cfg = _finetune_config(directory, tmp_path)
    with pytest.raises(ConfigValidationError) as err:
        finetune(cfg, forward_step)
    message = str(err.value)
    assert f"{shard} is truncated: tensor '" in message and "(download the file again)" in message
    assert any(f"tensor {t!r} needs bytes" in message for t in header)


@pytest.mark.parametrize(
    "field, value, tensor, shapes",
    [
        ("vocab_size", 300, "model.embed_tokens.weight", "has shape [256, 64], config.json implies [300, 64]"),
        ("num_key_value_heads", 4, "model.layers.0.self_attn.k_proj.weight", "has shape [32, 64], config.json implies [64, 64]"),
    ],
)
def test_shapes_that_do_not_match_config_json_name_file_and_tensor(tmp_path, capsys, no_model_building, field, value, tensor, shapes):
    directory = _sharded(tmp_path)
    file = _index(directory)[tensor]
    config = json.loads(open(os.path.join(directory, "config.json")).read())
    config[field] = value
    open(os.path.join(directory, "config.json"), "w").write(json.dumps(config))
    cfg = _finetune_config(directory, tmp_path)
    with pytest.raises(ConfigValidationError) as err:
        finetune(cfg, forward_step)
    assert f"checkpoint.pretrained_checkpoint: {file}: tensor {tensor!r} {shapes}" in str(err.value)
    assert main(["hf", "import", directory, str(tmp_path / "ckpt")]) == 2  # the same check, same report
    assert f"{file}: tensor {tensor!r} {shapes}" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


def test_unsupported_architecture_is_a_config_error(tmp_path, capsys, no_model_building):
    directory = _sharded(tmp_path)
    config = json.loads(open(os.path.join(directory, "config.json")).read())
    config["architectures"] = ["GPT2LMHeadModel"]
    open(os.path.join(directory, "config.json"), "w").write(json.dumps(config))
    with pytest.raises(ConfigValidationError, match=r"config.json: architectures=\['GPT2LMHeadModel'\] is not supported"):
        GPTModelProvider.from_hf(directory)
    assert main(["hf", "import", directory, str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    from megatron_bridge.models.hf.registry import supported

    assert f"{directory}/config.json: architectures=['GPT2LMHeadModel'] is not supported (convert one of: {supported()})" in err


def test_weight_files_that_disagree_with_their_index_or_config_name_file_and_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_bridge.config.errors import Problems
    from megatron_bridge.models.hf.load import check_hf_directory

    directory = _sharded(tmp_path)
    weight_map = _index(directory)
    shard = weight_map["model.norm.weight"]
    tensors = load_file(os.path.join(directory, shard))
    tensors.pop("model.norm.weight")  # listed in the index, absent from the file
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors.get(
        "model.layers.0.mlp.down_proj.weight", torch.zeros(64, 96)
    ).to(torch.int32)  # not floating point
    save_file(tensors, os.path.join(directory, shard))
    weight_map["model.layers.0.mlp.down_proj.weight"] = shard
    weight_map["model.layers.0.self_attn.rotary_emb.inv_freq"] = shard  # recomputed, ignored
    weight_map["model.extra.weight"] = shard  # nothing uses it
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    problems = Problems("hf")
    assert check_hf_directory(directory, problems) is None
    errors = [str(p) for p in problems]
    assert "hf: model.safetensors.index.json lists tensor 'model.extra.weight', which config.json does not account for" in errors[0]
    assert any(f"{shard} has no tensor 'model.norm.weight', though the index lists it there" in e for e in errors)
    assert any(f"{shard}: tensor 'model.layers.0.mlp.down_proj.weight' has dtype I32" in e for e in errors)


@pytest.mark.timeout(120)
def test_tied_config_json_with_a_different_lm_head_in_the_weights_is_refused_by_field(tmp_path):
    """transformers leaves embeddings untied when the files also hold an lm_head.weight that
    differs from them: converting such a model tied would change its logits. The same matrix
    twice converts as config.json says; untied, the model is transformers' again."""
    import subprocess
    import sys

    from factories import source_tree_env
    from safetensors.torch import load_file, save_file

    from megatron_bridge.config.errors import Problems
    from megatron_bridge.models.hf.load import check_hf_directory

    directory = save_tiny("llama_tied", str(tmp_path / "hf"))
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    assert check_hf_directory(directory, Problems()) is not None
    tensors["lm_head.weight"][-1] += 1.0
    save_file(tensors, path, metadata={"format": "pt"})
    argv = [sys.executable, "-m", "megatron_bridge", "hf", "import", directory, str(tmp_path / "ckpt")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=100, env=source_tree_env())
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        f"{directory}/config.json: field tie_word_embeddings = true, but the weights also hold an lm_head.weight that "
        "differs from model.embed_tokens.weight" in done.stderr
    )
    assert 'set "tie_word_embeddings": false in config.json' in done.stderr and not (tmp_path / "ckpt").exists()
    config = json.loads(open(os.path.join(directory, "config.json")).read())
    config["tie_word_embeddings"] = False
    open(os.path.join(directory, "config.json"), "w").write(json.dumps(config))
    tokens = random_tokens(256)
    assert torch.allclose(megatron_logits(directory, tokens), hf_logits(directory, tokens), atol=1e-4)


def test_export_needs_a_checkpoint_of_ours(tmp_path, capsys):
    (tmp_path / "iter_0000003").mkdir()
    assert main(["hf", "export", str(tmp_path / "iter_0000003"), str(tmp_path / "out")]) == 2
    assert "no run_config.yaml: the model architecture is unknown" in capsys.readouterr().err
    assert main(["hf", "export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
