"""OLMo 2 and Phi-3 through the Hugging Face bridge: config.json both ways, refusals by field, the
fused-tensor rules, parameter counts against transformers' models, and LoRA adapters that `peft`
loads. Logits, round trips and TP2 are in test_hf_weights / test_hf_parallel (parametrized over
every tiny family)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from factories import tiny_config
from hf_models import family_configs, hf_reference_model, random_tokens, save_tiny

from megatron_bridge import models as M
from megatron_bridge.config.errors import ConfigValidationError, Problems
from megatron_bridge.models import GPTModelProvider, count_parameters
from megatron_bridge.models.hf import mapping
from megatron_bridge.models.hf.config import (
    architecture_differences,
    hf_config_from_provider,
    provider_from_hf_config,
)
from megatron_bridge.models.hf.registry import families, family_of_provider

pytestmark = pytest.mark.timeout(300)
NEW = ["olmo2", "phi3", "phi3_partial"]


def config_dict(name: str) -> dict:
    cfg = family_configs()[name]
    return {**cfg.to_dict(), "architectures": [type(cfg).__name__.replace("Config", "ForCausalLM")]}


def from_config_json(tmp_path, data: dict):
    (tmp_path / "config.json").write_text(json.dumps(data))
    return GPTModelProvider.from_hf(str(tmp_path))


def test_from_hf_sets_the_layers_of_each_family(tmp_path):
    olmo = from_config_json(tmp_path, config_dict("olmo2"))
    assert type(olmo) is M.Olmo2ModelProvider and olmo.transformer_impl == "local"
    assert not olmo.input_layernorms and olmo.output_layernorms
    assert olmo.qk_layernorm and not olmo.qk_layernorm_per_head
    assert (olmo.num_layers, olmo.hidden_size, olmo.num_query_groups, olmo.kv_channels) == (2, 64, 2, 16)
    phi = from_config_json(tmp_path, config_dict("phi3"))
    assert type(phi) is M.Phi3ModelProvider and phi.window_size == (7, 0) and phi.rotary_percent == 1.0
    assert phi.input_layernorms and not phi.output_layernorms and not phi.share_embeddings_and_output_weights
    partial = from_config_json(tmp_path, config_dict("phi3_partial"))
    assert partial.rotary_percent == 0.5 and partial.share_embeddings_and_output_weights and partial.window_size is None
    for p in (olmo, phi, partial):
        p.finalize()


@pytest.mark.parametrize("name", NEW)
def test_provider_to_config_json_and_back(tmp_path, name):
    from transformers import AutoConfig

    provider = provider_from_hf_config(config_dict(name), Problems())
    provider.finalize()
    written = hf_config_from_provider(provider, "float32")
    assert written["architectures"] == config_dict(name)["architectures"]
    again = provider_from_hf_config(written, Problems())
    assert type(again) is type(provider) and not architecture_differences(again, provider)
    for field in ("rotary_base", "window_size", "rotary_percent", "layernorm_epsilon", "hidden_dropout"):
        assert getattr(again, field) == getattr(provider, field), field
    (tmp_path / "config.json").write_text(json.dumps(written))
    loaded, original = AutoConfig.from_pretrained(tmp_path), family_configs()[name]
    for attr in ("hidden_size", "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(loaded, attr) == getattr(original, attr), attr
    assert loaded.rope_parameters == original.rope_parameters
    assert getattr(loaded, "sliding_window", None) == getattr(original, "sliding_window", None)


def test_providers_export_as_the_family_that_computes_them():
    olmo_like = GPTModelProvider(
        num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, position_embedding_type="rope",
        input_layernorms=False, output_layernorms=True, qk_layernorm=True, qk_layernorm_per_head=False,
    )  # fmt: skip
    assert family_of_provider(olmo_like).architecture == "Olmo2ForCausalLM"
    assert family_of_provider(M.Phi3ModelProviderMini()).architecture == "Phi3ForCausalLM"
    assert family_of_provider(M.LlamaModelProvider(rotary_percent=0.5)).architecture == "Phi3ForCausalLM"
    assert family_of_provider(M.Llama3ModelProvider8B()).architecture == "LlamaForCausalLM"
    problems = Problems()
    assert family_of_provider(M.LlamaModelProvider(output_layernorms=True), problems) is None
    assert [p.path for p in problems] == ["model.output_layernorms"]
    assert "True has no Hugging Face counterpart among " in str(list(problems)[0])


def test_a_mixtral_router_without_renormalized_top_k_is_not_exported_as_mixtral():
    """transformers' Mixtral renormalizes the top-k softmax weights (megatron-core's
    moe_router_pre_softmax=False); Qwen3-MoE writes either as norm_topk_prob."""
    moe = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    assert family_of_provider(M.MixtralModelProvider(**moe)).architecture == "MixtralForCausalLM"
    problems = Problems()
    assert family_of_provider(M.MixtralModelProvider(**moe, moe_router_pre_softmax=True), problems) is None
    assert [p.path for p in problems] == ["model.moe_router_pre_softmax"]
    assert family_of_provider(M.Qwen3MoEModelProvider(**moe, moe_router_pre_softmax=True)).architecture == "Qwen3MoeForCausalLM"


REFUSED = [
    ("olmo2", {"attention_bias": True}, "field attention_bias = True cannot be converted"),
    ("olmo2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "field rope_parameters.rope_type = 'yarn' is not implemented"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                  "long_factor": [2.0] * 8, "partial_rotary_factor": 1.0}},
     "field rope_parameters.rope_type = 'longrope': Phi-3's long-context rope scaling is not implemented"),
    ("phi3", {"rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     "field rope_scaling.rope_type = 'su': Phi-3's long-context rope scaling is not implemented"),
    ("phi3", {"embd_pdrop": 0.1}, "field embd_pdrop = 0.1 differs from resid_pdrop=0.0"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     "field partial_rotary_factor = 1.5 is not a fraction in (0, 1]"),
    ("phi3", {"hidden_act": "gelu"}, "field hidden_act = 'gelu' cannot be converted"),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, change, message", REFUSED, ids=[f"{n}-{list(c)[0]}-{i}" for i, (n, c, _) in enumerate(REFUSED)]
)
def test_settings_that_change_the_math_are_refused_by_name(tmp_path, name, change, message):
    with pytest.raises(ConfigValidationError) as err:
        from_config_json(tmp_path, {**config_dict(name), **change})
    assert message in str(err.value) and f"{tmp_path}/config.json" in str(err.value)


def test_an_unsupported_architecture_lists_the_registered_ones_sorted(tmp_path):
    with pytest.raises(ConfigValidationError) as err:
        from_config_json(tmp_path, {**config_dict("olmo2"), "architectures": ["OlmoForCausalLM"]})
    listed = re.search(r"convert one of: ([^)]*)\)", str(err.value)).group(1).split(", ")
    assert listed == sorted(f.architecture for f in families()) and {"Olmo2ForCausalLM", "Phi3ForCausalLM"} <= set(
        listed
    )


def test_fused_qkv_and_gate_up_tensors_round_trip_per_tensor_parallel_rank(tmp_path):
    """qkv_proj holds all query heads, then all key heads, then all value heads; gate_up_proj all
    gate rows, then all up rows. Each tensor-parallel rank reads its query groups / rows."""
    from safetensors.torch import save_file

    from megatron_bridge.models.hf.reader import SafetensorsReader

    heads, groups, hd, hidden, ffn = 4, 2, 3, 5, 6
    qkv_rows = torch.arange(float((heads + 2 * groups) * hd)).unsqueeze(1).expand(-1, hidden).contiguous()
    gate_up = torch.randn(2 * ffn, hidden)
    save_file({"qkv": qkv_rows, "gate_up": gate_up}, str(tmp_path / "model.safetensors"))
    reader = SafetensorsReader(str(tmp_path))
    qkv, fc1 = mapping.FusedQKV("qkv", heads, groups, hd), mapping.FusedGated("gate_up")
    for size in (1, 2):
        parts = [torch.empty((heads + 2 * groups) * hd // size, hidden) for _ in range(size)]
        for rank, dest in enumerate(parts):
            qkv.load(reader, dest, mapping.Partition(0, rank, size))
        # group 1 (on rank 1 of 2): query heads 2-3 (rows 6-11), key head 1 (rows 15-17), value head 1 (rows 21-23)
        group1 = torch.cat(parts)[(heads // groups + 2) * hd :, 0].tolist()
        assert group1 == [*range(6, 12), *range(15, 18), *range(21, 24)]
        assert torch.equal(qkv.to_hf(parts, mapping.Partition(0, 0, size))["qkv"], qkv_rows)
        rows = [torch.empty(2 * ffn // size, hidden) for _ in range(size)]
        for rank, dest in enumerate(rows):
            fc1.load(reader, dest, mapping.Partition(0, rank, size))
        half = ffn // size
        assert torch.equal(rows[-1], torch.cat([gate_up[ffn - half : ffn], gate_up[2 * ffn - half :]]))  # [gate; up]
        assert torch.equal(fc1.to_hf(rows, mapping.Partition(0, 0, size))["gate_up"], gate_up)
    assert qkv.hf_shapes((24, hidden)) == {"qkv": (24, hidden)} and fc1.hf == ("gate_up",)


@pytest.mark.parametrize(
    "config, provider, published",
    [
        (dict(model="olmo2", vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=32, rope_theta=500000.0, pad_token_id=1),
         M.Olmo2ModelProvider7B, 7.30e9),
        (dict(model="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=32, sliding_window=2047, pad_token_id=0),
         M.Phi3ModelProviderMini, 3.82e9),
    ],
    ids=["olmo2-7b", "phi3-mini"],
)  # fmt: skip
def test_parameter_counts_are_those_of_the_published_models(config, provider, published):
    """The planner's count equals the transformers model built (on the meta device) from the
    published config, plus the rows that pad the vocabulary to a multiple of 128."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    hf_config = AutoConfig.for_model(config.pop("model"), **config)
    with torch.device("meta"):
        hf_count = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config).parameters())
    p = provider()
    padding = (p.padded_vocab_size() - p.vocab_size) * p.hidden_size * 2  # untied: embedding and output layer
    assert count_parameters(p).total == hf_count + padding
    assert abs(count_parameters(p).total - published) < 0.01 * published


def test_phi3_adapters_export_onto_the_fused_modules():
    from megatron_bridge.peft.export import to_peft_state

    model = M.Phi3ModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                                ffn_hidden_size=96)  # fmt: skip
    rows = torch.arange(128.0).unsqueeze(1)  # per group: 2 query heads, 1 key head, 1 value head of 16 rows
    state = to_peft_state(
        {
            "decoder.layers.1.self_attention.linear_qkv.lora_B": rows,
            "decoder.layers.1.mlp.linear_fc1.lora_B": torch.arange(192.0).unsqueeze(1),
            "decoder.layers.1.mlp.linear_fc1.lora_A": torch.ones(4, 64),
        },
        model,
    )
    prefix = "base_model.model.model.layers.1."
    qkv = state[prefix + "self_attn.qkv_proj.lora_B.weight"][:, 0].tolist()
    assert qkv == [*range(32), *range(64, 96), *range(32, 48), *range(96, 112), *range(48, 64), *range(112, 128)]
    assert state[prefix + "mlp.gate_up_proj.lora_B.weight"][:, 0].tolist() == list(range(192))  # [gate; up] as stored
    assert torch.equal(state[prefix + "mlp.gate_up_proj.lora_A.weight"], torch.ones(4, 64))
    assert not any("q_proj" in k or "gate_proj" in k for k in state)


# ---------------------------------------------------------------------- LoRA -> peft
@pytest.mark.parametrize("name", ["olmo2", "phi3", "gemma3", "gemma2"])
def test_lora_adapters_on_an_imported_model_load_in_peft_with_our_logits(tmp_path, name):
    """Import the Hugging Face model, train LoRA adapters (B starts non-zero, so they matter),
    export them: `peft` puts them on transformers' model of the same directory and computes our
    adapted model's logits."""
    import peft

    from megatron_bridge.cli.main import main
    from megatron_bridge.peft import LoRA
    from megatron_bridge.peft.merge import read_adapter_checkpoint
    from megatron_bridge.peft.offline import load_weights, single_process_model
    from megatron_bridge.training.config import CheckpointConfig, TrainingConfig, ValidationConfig
    from megatron_bridge.training.finetune import finetune
    from megatron_bridge.training.gpt_step import forward_step

    source, base, run, adapters = (str(tmp_path / d) for d in ("hf", "base", "lora", "adapters"))
    save_tiny(name, source)
    assert main(["hf", "import", source, base]) == 0
    model = GPTModelProvider.from_hf(source)
    model.seq_length = 32
    cfg = tiny_config(
        model=model,
        train=TrainingConfig(train_iters=2, global_batch_size=4, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        checkpoint=CheckpointConfig(pretrained_checkpoint=base, save=run),
    )
    cfg.peft = LoRA(dim=4, alpha=8, lora_B_init_method="kaiming")
    finetune(cfg, forward_step)
    assert main(["peft", "export", run, adapters]) == 0
    written = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    fused = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    separate = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert set(written["target_modules"]) == (fused if name == "phi3" else separate)

    tokens = random_tokens(family_configs()[name].vocab_size)
    directory, _, run_cfg, _ = read_adapter_checkpoint(run)
    with single_process_model(run_cfg) as ours:
        load_weights(ours, base, "base")
        load_weights(ours, directory, "adapters")
        device = next(ours.parameters()).device
        with torch.no_grad():
            on_model = tokens.to(device)
            adapted = ours(on_model, torch.arange(tokens.shape[1], device=device).expand_as(on_model), None).float().cpu()
    hf_base = hf_reference_model(source)
    with torch.no_grad():
        plain = hf_base(tokens).logits
        theirs = peft.PeftModel.from_pretrained(hf_base, adapters).eval()(tokens).logits
    assert (adapted - plain).abs().max().item() > 1e-2  # the adapters change the logits
    assert (theirs - adapted).abs().max().item() < 1e-4


# ---------------------------------------------------------------------- eval
@pytest.mark.timeout(400)
def test_eval_of_olmo2_and_phi3_directories_gives_the_loss_of_transformers(tmp_path):
    """`evaluate()` (what `mbridge eval` runs) on each Hugging Face directory: transformers' mean
    next-token loss over the same documents, each truncated to the model's sequence length."""
    from inference_models import hf_tokenizer, tiny_hf_model, transformers_logprobs, transformers_model
    from text_data import documents, write_jsonl

    from megatron_bridge.inference import evaluate

    docs = documents(5, seed=4, sentences=(2, 5))
    data = str(tmp_path / "docs.jsonl")
    write_jsonl(data, [{"text": d} for d in docs])
    for name in ("olmo2", "phi3"):
        directory = tiny_hf_model(name, tmp_path / name)
        result = evaluate(directory, data)
        hf, tok = transformers_model(directory), hf_tokenizer(directory)
        encoded = [tok.encode(d).ids[: family_configs()[name].max_position_embeddings] for d in docs]
        loss = -sum(transformers_logprobs(hf, ids).sum().item() for ids in encoded)
        count = sum(len(ids) - 1 for ids in encoded)
        assert result.tokens == count, name
        assert abs(result.loss - loss / count) / (loss / count) < 1e-4, (name, result.loss, loss / count)
