"""Hugging Face config.json <-> model providers, name mapping, config fields and recipe options
(no model is built here)."""

from __future__ import annotations

import json

import pytest
import torch
from factories import tiny_config
from hf_models import family_configs

from megatron_bridge import models as M
from megatron_bridge.config.errors import ConfigValidationError, Problems
from megatron_bridge.models import GPTModelProvider
from megatron_bridge.models.hf import mapping
from megatron_bridge.models.hf.config import (
    architecture_differences,
    hf_config_from_provider,
    provider_from_hf_config,
)
from megatron_bridge.models.hf.load import expected_weights
from megatron_bridge.training.config import CheckpointConfig, runtime_config_update

pytestmark = pytest.mark.timeout(120)

FAMILY_CLASS = {
    "llama": M.LlamaModelProvider,
    "llama_tied": M.LlamaModelProvider,
    "mistral": M.MistralModelProvider,
    "mixtral": M.MixtralModelProvider,
    "qwen2": M.Qwen2ModelProvider,
    "qwen3": M.Qwen3ModelProvider,
    "qwen3_moe": M.Qwen3MoEModelProvider,
}


def write_config(directory, data: dict, index: bool = True) -> str:
    """A Hugging Face directory with `data` as config.json and (optionally) an index listing
    every tensor config.json implies, but no weights."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(data))
    if index:
        _, expected, _ = expected_weights(data)
        weight_map = {name: f"model-0000{i % 2 + 1}-of-00002.safetensors" for i, name in enumerate(expected)}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(directory)


def config_dict(name: str) -> dict:
    data = family_configs()[name].to_dict()
    data["architectures"] = [type(family_configs()[name]).__name__.replace("Config", "ForCausalLM")]
    return data


@pytest.mark.parametrize("name", list(FAMILY_CLASS))
def test_from_hf_returns_the_family_provider_with_every_architecture_field(tmp_path, name):
    cfg = family_configs()[name]
    cfg.save_pretrained(tmp_path)  # transformers' own config.json
    p = GPTModelProvider.from_hf(str(tmp_path))
    assert type(p) is FAMILY_CLASS[name]
    assert (p.num_layers, p.hidden_size, p.num_attention_heads, p.num_query_groups) == (2, 64, 4, 2)
    assert p.vocab_size == cfg.vocab_size and p.layernorm_epsilon == 1e-5 and p.init_method_std == 0.125
    assert p.kv_channels == (32 if name == "qwen3" else 16)
    assert p.share_embeddings_and_output_weights == (name == "llama_tied")
    assert p.add_qkv_bias == (name == "qwen2") and p.qk_layernorm == (name in ("qwen3", "qwen3_moe"))
    assert p.window_size == ((7, 0) if name == "mistral" else None)
    if name == "llama":
        assert p.rope_scaling and p.rope_scaling_factor == 8.0 and p.rotary_base == 500000
    if name in ("mixtral", "qwen3_moe"):
        assert (p.num_moe_experts, p.moe_router_topk) == (4, 2)
        assert p.moe_ffn_hidden_size == (48 if name == "mixtral" else 32)
    if name == "qwen3_moe":
        assert not p.moe_router_pre_softmax  # norm_topk_prob: softmax over the chosen experts
    assert {"num_layers", "hidden_size", "vocab_size", "kv_channels"} <= p.explicit_fields()
    p.finalize()


def test_a_published_transformers4_config_json(tmp_path):
    """Llama 3.1 8B's config.json as published (rope_theta / rope_scaling, transformers 4)."""
    data = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
    }  # fmt: skip
    p = GPTModelProvider.from_hf(write_config(tmp_path, data, index=False))
    reference = M.Llama31ModelProvider405B(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336)
    assert type(p) is M.LlamaModelProvider and not architecture_differences(p, reference)
    assert p.rope_scaling and p.rope_scaling_factor == 8.0 and p.rotary_base == 500000 and p.seq_length == 131072
    assert M.Qwen3ModelProvider.from_hf is not None
    with pytest.raises(TypeError, match="holds a LlamaModelProvider model, not a Qwen3ModelProvider"):
        M.Qwen3ModelProvider.from_hf(str(tmp_path))


REFUSED = [
    ("llama", {"architectures": ["GPT2LMHeadModel"]}, "architectures=['GPT2LMHeadModel'] is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "field rope_parameters.rope_type = 'yarn' is not implemented"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_theta": 5e5}},
     "field rope_parameters.low_freq_factor = 2.0 (megatron-core implements 1.0)"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16},
     "field use_sliding_window = True cannot be converted (per-layer sliding windows"),
    ("llama", {"attention_bias": True}, "field attention_bias = True cannot be converted"),
    ("llama", {"hidden_act": "gelu"}, "field hidden_act = 'gelu' cannot be converted"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "field quantization_config = quantized weights"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "field mlp_only_layers = [1] cannot be converted"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
     "field rope_parameters.factor = None is not a positive number (linear rope scaling needs one)"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_theta": 5e5}},
     "field rope_parameters.factor = None is not a positive number (llama3 rope scaling needs one)"),
    ("llama", {"rope_scaling": {"type": "linear", "factor": "2"}}, "field rope_scaling.factor = '2' is not a positive number"),
    # normalized top-1 routing weighs the expert by 1; megatron-core's top-1 by its probability
    ("mixtral", {"num_experts_per_tok": 1}, "field num_experts_per_tok = 1 cannot be converted"),
    ("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": True},
     "field norm_topk_prob = True with num_experts_per_tok = 1 cannot be converted"),
]  # fmt: skip


@pytest.mark.parametrize("name, change, message", REFUSED, ids=[m.split(" ")[0] + str(i) for i, (_, _, m) in enumerate(REFUSED)])
def test_settings_we_would_silently_change_are_refused_by_name(tmp_path, name, change, message):
    data = {**config_dict(name), **change}
    directory = write_config(tmp_path, data, index=False)
    with pytest.raises(ConfigValidationError) as err:
        GPTModelProvider.from_hf(directory)
    assert message in str(err.value)
    assert f"{directory}/config.json" in str(err.value)


@pytest.mark.parametrize("name", list(FAMILY_CLASS))
def test_provider_to_config_json_and_back(tmp_path, name):
    from transformers import AutoConfig

    provider = provider_from_hf_config(config_dict(name), Problems())
    provider.finalize()
    written = hf_config_from_provider(provider, "float32")
    again = provider_from_hf_config(written, Problems())
    assert type(again) is type(provider) and not architecture_differences(again, provider)
    for field in ("rotary_base", "rope_scaling", "window_size", "moe_router_pre_softmax", "layernorm_epsilon"):
        assert getattr(again, field) == getattr(provider, field), field
    (tmp_path / "config.json").write_text(json.dumps(written))
    loaded = AutoConfig.from_pretrained(tmp_path)  # transformers reads what we write
    original = family_configs()[name]
    for attr in ("hidden_size", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert getattr(loaded, attr) == getattr(original, attr), attr
    assert loaded.rope_parameters["rope_theta"] == original.rope_parameters["rope_theta"]


def test_te_and_grouped_expert_names_map_like_local_ones():
    llama = mapping.architecture(config_dict("llama"))
    assert mapping.rule_for(llama, "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight").hf == (
        "model.layers.1.input_layernorm.weight",
    )
    assert mapping.rule_for(llama, "decoder.layers.1.mlp.linear_fc1.layer_norm_weight").hf == (
        "model.layers.1.post_attention_layernorm.weight",
    )
    assert mapping.rule_for(llama, "decoder.layers.0.mlp.linear_fc1.weight").hf == (
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    )
    mixtral = mapping.architecture(config_dict("mixtral"))
    grouped = mapping.rule_for(mixtral, "decoder.layers.1.mlp.experts.linear_fc1.weight3")
    sequential = mapping.rule_for(mixtral, "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight")
    assert grouped.hf == sequential.hf == (
        "model.layers.1.block_sparse_moe.experts.3.w1.weight",
        "model.layers.1.block_sparse_moe.experts.3.w3.weight",
    )
    assert mapping.rule_for(mixtral, "decoder.layers.0.mlp.router.weight").hf == ("model.layers.0.block_sparse_moe.gate.weight",)
    qwen3_moe = mapping.architecture(config_dict("qwen3_moe"))
    assert mapping.rule_for(qwen3_moe, "decoder.layers.0.mlp.experts.linear_fc2.weight1").hf == (
        "model.layers.0.mlp.experts.1.down_proj.weight",
    )
    tied = mapping.architecture(config_dict("llama_tied"))
    assert mapping.rule_for(tied, "output_layer.weight").hf == ("model.embed_tokens.weight",)
    assert mapping.rule_for(llama, "decoder.layers.0.self_attention.linear_qkv.bias") is None  # no biases


def test_fused_qkv_and_gated_layouts_round_trip_per_tensor_parallel_rank(tmp_path):
    """Rows of q/k/v interleave per query group; tensor-parallel ranks hold whole groups."""
    from safetensors.torch import save_file

    from megatron_bridge.models.hf.reader import SafetensorsReader

    heads, groups, hd, hidden = 4, 2, 3, 5
    hf = {n: torch.randn(rows, hidden) for n, rows in (("q", heads * hd), ("k", groups * hd), ("v", groups * hd))}
    hf.update(gate=torch.randn(6, hidden), up=torch.randn(6, hidden), o=torch.randn(hidden, 8))
    save_file(hf, str(tmp_path / "model.safetensors"))
    reader = SafetensorsReader(str(tmp_path))
    qkv, gated = mapping.QKV("q", "k", "v", heads, groups, hd), mapping.Gated("gate", "up")
    for size in (1, 2):
        parts = []
        for rank in range(size):
            dest = torch.empty((heads + 2 * groups) * hd // size, hidden)
            qkv.load(reader, dest, mapping.Partition(0, rank, size))
            parts.append(dest)
        group0 = parts[0][: (heads // groups + 2) * hd]  # q heads 0-1, k head 0, v head 0
        assert torch.equal(group0, torch.cat([hf["q"][: 2 * hd], hf["k"][:hd], hf["v"][:hd]]))
        back = qkv.to_hf(parts, mapping.Partition(0, 0, size))
        assert all(torch.equal(back[n], hf[n]) for n in "qkv")
        fc1 = [torch.empty(12 // size, hidden) for _ in range(size)]
        for rank, dest in enumerate(fc1):
            gated.load(reader, dest, mapping.Partition(0, rank, size))
        assert torch.equal(fc1[-1][: 6 // size], hf["gate"][-6 // size :])  # [gate; up] on every rank
        back = gated.to_hf(fc1, mapping.Partition(0, 0, size))
        assert torch.equal(back["gate"], hf["gate"]) and torch.equal(back["up"], hf["up"])
        columns = [torch.empty(hidden, 8 // size, dtype=torch.bfloat16) for _ in range(size)]  # via get_slice
        for rank, dest in enumerate(columns):
            mapping.Copy("o").load(reader, dest, mapping.Partition(1, rank, size))
        assert torch.equal(torch.cat(columns, dim=1), hf["o"].to(torch.bfloat16))


# ---------------------------------------------------------------------- config fields
def test_save_hf_has_the_save_hf_weights_alias_and_needs_a_save_directory():
    from megatron_bridge.config.overrides import process_config_with_overrides

    assert CheckpointConfig(save_hf_weights=True).save_hf is True
    cfg = tiny_config()
    process_config_with_overrides(cfg, cli_overrides=["checkpoint.save_hf_weights=true", "checkpoint.save_hf_dtype=bf16"])
    assert cfg.checkpoint.save_hf and cfg.checkpoint.save_hf_dtype == "bf16"
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg)
    errors = "\n".join(err.value.errors)
    assert "checkpoint.save_hf: the Hugging Face directory is written next to the final checkpoint, and checkpoint.save is not set" in errors
    # the tiny GPT (LayerNorm, learned positions, biases) has no Hugging Face family
    assert "model.normalization: 'LayerNorm' has no Hugging Face counterpart" in errors
    assert "model.add_bias_linear: True has no Hugging Face counterpart" in errors
    with pytest.raises(TypeError, match="save_hf_dtype"):
        CheckpointConfig(save_hf_dtype="int8")


def test_model_config_must_match_the_pretrained_hugging_face_model(tmp_path):
    directory = write_config(tmp_path / "hf", config_dict("llama"))
    cfg = tiny_config(model=GPTModelProvider.from_hf(directory))
    cfg.model.seq_length = 32
    cfg.checkpoint.pretrained_checkpoint = directory
    runtime_config_update(cfg)  # config.json and index agree with the model: no weights needed
    other = tiny_config(model=M.LlamaModelProvider(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32))
    other.checkpoint.pretrained_checkpoint = directory
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(other)
    assert f"model.hidden_size: 32, but the Hugging Face model in {directory} has 64" in str(err.value)
    assert "GPTModelProvider.from_hf(" in str(err.value)


def test_a_model_of_the_same_shapes_that_computes_otherwise_is_refused_unless_set_on_purpose(tmp_path, caplog):
    """Llama 3.1 weights (llama3 rope scaling) in a model without the scaling have every shape
    right and compute something else: refused by field, unless the field was set explicitly."""
    import logging

    directory = write_config(tmp_path / "hf", config_dict("llama"))  # rope_theta 5e5, llama3 scaling x8
    shapes = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  vocab_size=256, seq_length=32, layernorm_epsilon=1e-5)  # fmt: skip
    cfg = tiny_config(model=M.LlamaModelProvider(**shapes))
    cfg.checkpoint.pretrained_checkpoint = directory
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg)
    assert sorted(p.path for p in err.value.problems) == ["model.rope_scaling", "model.rotary_base"]
    assert f"model.rope_scaling: False, but the Hugging Face model in {directory} has True" in str(err.value)
    assert f"--recipe-arg pretrained={directory}" in str(err.value) and "or set model.rope_scaling" in str(err.value)
    cfg = tiny_config(model=M.LlamaModelProvider(**shapes, rope_scaling=True, rope_scaling_factor=8.0, rotary_base=1_000_000))
    cfg.checkpoint.pretrained_checkpoint = directory
    with caplog.at_level(logging.WARNING, logger="megatron_bridge"):
        runtime_config_update(cfg)  # a longer context on purpose: kept, and said
    assert f"model.rotary_base: 1000000, but the Hugging Face model in {directory} has 500000" in caplog.text


def test_index_must_list_the_tensors_config_json_implies(tmp_path):
    data = config_dict("llama")
    directory = write_config(tmp_path / "hf", data)
    data["num_hidden_layers"] = 3  # the weights have 2 layers
    (tmp_path / "hf" / "config.json").write_text(json.dumps(data))
    cfg = tiny_config(model=GPTModelProvider.from_hf(directory))
    cfg.model.seq_length = 32
    cfg.checkpoint.pretrained_checkpoint = directory
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg)
    assert "checkpoint.pretrained_checkpoint: model.safetensors.index.json has no tensor 'model.layers.2." in str(err.value)


def test_the_tokenizer_of_the_pretrained_directory_is_used_unless_one_is_named(tmp_path):
    from megatron_bridge.training.tokenizers.config import TokenizerConfig

    directory = write_config(tmp_path / "hf", config_dict("llama"))
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    cfg = tiny_config(model=GPTModelProvider.from_hf(directory), tokenizer=TokenizerConfig())
    cfg.model.seq_length = 32
    cfg.checkpoint.pretrained_checkpoint = directory
    runtime_config_update(cfg)
    assert (cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model) == ("HuggingFaceTokenizer", directory)
    named = tiny_config(model=GPTModelProvider.from_hf(directory))  # NullTokenizer named: kept
    named.model.seq_length = 32
    named.checkpoint.pretrained_checkpoint = directory
    runtime_config_update(named)
    assert named.tokenizer.tokenizer_type == "NullTokenizer"


# ---------------------------------------------------------------------- recipes and the CLI
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 128256, "hidden_act": "silu",
}  # fmt: skip


def test_finetune_recipe_takes_a_hugging_face_directory_as_pretrained(tmp_path):
    from recipes import llama3_8b_finetune_config

    directory = write_config(tmp_path / "Meta-Llama-3-8B", LLAMA3_8B)
    (tmp_path / "Meta-Llama-3-8B" / "tokenizer.json").write_text("{}")
    cfg = llama3_8b_finetune_config(pretrained=directory, dataset_root=str(tmp_path))
    assert cfg.checkpoint.pretrained_checkpoint == directory
    assert type(cfg.model) is M.LlamaModelProvider and cfg.model.num_layers == 32 and cfg.model.seq_length == 4096
    assert cfg.model.tensor_model_parallel_size == 2 and cfg.model.sequence_parallel  # the recipe's layout
    assert (cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model) == ("HuggingFaceTokenizer", directory)
    with pytest.raises(TypeError, match="unknown option 'pretraind'"):
        llama3_8b_finetune_config(pretraind=directory)


def test_dry_run_of_the_8b_finetune_from_config_json_and_index_alone(tmp_path, capsys, monkeypatch):
    from megatron_bridge.cli.main import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    directory = write_config(tmp_path / "Meta-Llama-3-8B", LLAMA3_8B)
    rc = main([
        "finetune", "--recipe", "llama3_8b_finetune_config", "--recipe-arg", f"pretrained={directory}",
        "--recipe-arg", f"dataset_root={tmp_path / 'sft'}", "--dry-run",  # data not on this machine
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert f"pretrained_checkpoint: {directory}" in out and "_target_: megatron_bridge.models.LlamaModelProvider" in out
    assert "# parameters:            8,030,261,248 (8.03B)" in out
    assert "tokenizer_type: NullTokenizer" in out and "vocab_size: 128256" in out  # no tokenizer in the directory


def test_vocab_size_of_the_weights_when_the_tokenizer_is_missing(tmp_path):
    """An unset model.vocab_size is the Hugging Face weights' even when the tokenizer the config
    names is not on this machine (it is derived before the checks, which change nothing)."""
    from megatron_bridge.training.config import runtime_config_update
    from recipes import llama3_8b_finetune_config

    directory = write_config(tmp_path / "Meta-Llama-3-8B", LLAMA3_8B)
    cfg = llama3_8b_finetune_config(pretrained=directory, dataset_root=str(tmp_path))
    cfg.model.vocab_size = None
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    cfg.tokenizer.tokenizer_model = str(tmp_path / "missing-tokenizer")
    runtime_config_update(cfg, world_size=8)
    assert cfg.model.vocab_size == 128256


def test_hf_command_usage_errors(tmp_path, capsys, monkeypatch):
    from megatron_bridge.cli.main import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["hf", "import", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "is not a Hugging Face model directory (config.json and model.safetensors[.index.json])" in capsys.readouterr().err
    directory = write_config(tmp_path / "hf", config_dict("llama"))
    assert main(["hf", "import", directory, str(tmp_path / "out"), "--tp", "3"]) == 2
    assert "--tp 3 --pp 1 --ep 1 do not lay out over 2 process(es)" in capsys.readouterr().err
    assert main(["hf", "export", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "big"]) == 2
    assert "--max-shard-size 'big': expected a size such as 5GB or 500MB" in capsys.readouterr().err
