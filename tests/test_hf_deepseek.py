"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) through the Hugging Face bridge: config.json both ways,
refusals by field, multi-token-prediction layers left out, the rotary row layouts, the expert
bias kept in fp32, the published models' parameter counts, LoRA adapters that `peft` loads, and
`mbridge eval` and greedy generation against transformers.
Logits, round trips, TP2 and EP2 are in test_hf_weights / test_hf_parallel (parametrized over the
tiny families)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from factories import tiny_config
from hf_models import family_configs, hf_logits, megatron_logits, random_tokens, save_tiny
from test_hf_weights import assert_bit_identical, read_all

from megatron_bridge import models as M
from megatron_bridge.config.errors import ConfigValidationError, Problems
from megatron_bridge.models import GPTModelProvider, count_parameters
from megatron_bridge.models.hf.config import architecture_differences, hf_config_from_provider, provider_from_hf_config
from megatron_bridge.models.hf.registry import family_of_provider

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def config_dict(name: str) -> dict:
    return {**family_configs()[name].to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}


def from_config_json(tmp_path, data: dict):
    (tmp_path / "config.json").write_text(json.dumps(data))
    return GPTModelProvider.from_hf(str(tmp_path))


def test_from_hf_sets_latent_attention_and_the_router(tmp_path):
    v3 = from_config_json(tmp_path, config_dict("deepseek_v3"))
    assert type(v3) is M.DeepSeekModelProvider and v3.multi_latent_attention and v3.qk_layernorm
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_head_dim, v3.qk_pos_emb_head_dim, v3.v_head_dim) == (24, 16, 16, 8, 12)
    assert (v3.rope_type, v3.rotary_scaling_factor, v3.original_max_position_embeddings) == ("yarn", 4.0, 16)
    assert (v3.mscale, v3.mscale_all_dim, v3.beta_fast, v3.beta_slow) == (0.707, 0.707, 32.0, 1.0)
    # the latents' norms have DeepSeek's fixed epsilon, the others config.json's rms_norm_eps
    assert (v3.latent_layernorm_epsilon, v3.layernorm_epsilon) == (1e-6, 1e-5)
    assert (v3.num_moe_experts, v3.moe_router_topk, v3.moe_ffn_hidden_size, v3.moe_shared_expert_intermediate_size) == (
        8, 4, 32, 32)  # fmt: skip
    assert (v3.moe_router_num_groups, v3.moe_router_group_topk, v3.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert v3.moe_layer_freq == [0, 1] and v3.moe_router_score_function == "sigmoid" and v3.moe_router_enable_expert_bias
    plain = from_config_json(tmp_path, config_dict("deepseek_v3_plain"))
    assert plain.q_lora_rank is None and plain.rope_type == "rope" and plain.mscale_all_dim == 0.0
    assert plain.moe_router_num_groups is None and plain.moe_router_group_topk is None
    for p in (v3, plain):
        p.finalize()


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_plain"])
def test_provider_to_config_json_and_back(tmp_path, name):
    from transformers import AutoConfig

    provider = provider_from_hf_config(config_dict(name), Problems())
    provider.finalize()
    written = hf_config_from_provider(provider, "float32")
    assert written["architectures"] == ["DeepseekV3ForCausalLM"] and written["num_nextn_predict_layers"] == 0
    again = provider_from_hf_config(written, Problems())
    assert type(again) is type(provider) and not architecture_differences(again, provider)
    for field in ("rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "moe_router_num_groups",
                  "moe_router_group_topk", "moe_router_topk_scaling_factor", "latent_layernorm_epsilon"):  # fmt: skip
        assert getattr(again, field) == getattr(provider, field), field
    (tmp_path / "config.json").write_text(json.dumps(written))
    loaded, original = AutoConfig.from_pretrained(tmp_path), family_configs()[name]
    for attr in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "n_group", "topk_group", "first_k_dense_replace",
                 "n_shared_experts", "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps", "head_dim"):  # fmt: skip
        assert getattr(loaded, attr) == getattr(original, attr), attr
    assert loaded.rope_parameters == original.rope_parameters
    assert loaded.rope_interleave  # the written weights hold megatron-core's interleaved rotary rows


def test_providers_export_as_deepseek_only_with_its_math():
    assert family_of_provider(M.DeepSeekV3ModelProvider()).architecture == "DeepseekV3ForCausalLM"
    assert family_of_provider(M.MoonlightModelProvider16B()).architecture == "DeepseekV3ForCausalLM"
    problems = Problems()
    # transformers ranks expert groups by their 2 best experts: 8 per token from 2 groups is not that
    assert family_of_provider(M.DeepSeekV3ModelProvider(moe_router_group_topk=2), problems) is None
    assert [p.path for p in problems] == ["model.moe_router_group_topk"]
    problems = Problems()
    assert family_of_provider(M.Llama3ModelProvider8B(multi_latent_attention=True), problems) is None
    assert "model.multi_latent_attention" in [p.path for p in problems]
    sigmoid_mixtral = M.MixtralModelProvider8x7B(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    assert family_of_provider(sigmoid_mixtral) is None


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
REFUSED = [
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
     "field rope_parameters.rope_type = 'linear' is not implemented (default and yarn are)"),
    ({"rope_parameters": {**YARN, "mscale_all_dim": 1.0}},
     "field rope_parameters.mscale = None with mscale_all_dim=1.0 is not implemented"),
    ({"rope_parameters": {**YARN, "attention_factor": 1.2}},
     "field rope_parameters.attention_factor = 1.2: an explicit attention factor is not implemented"),
    ({"rope_parameters": {**YARN, "truncate": False}}, "field rope_parameters.truncate = False: megatron-core rounds"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}},
     "field rope_scaling.original_max_position_embeddings = None is not a positive number"),
    ({"scoring_func": "softmax"}, "field scoring_func = 'softmax' cannot be converted"),
    ({"topk_method": "greedy"}, "field topk_method = 'greedy' cannot be converted"),
    ({"norm_topk_prob": False}, "field norm_topk_prob = False with num_experts_per_tok=4 is not implemented"),
    ({"topk_group": 1}, "field topk_group = 1 with num_experts_per_tok=4: transformers ranks a group by its 2 best"),
    ({"n_group": 3}, "field n_group = 3: the 8 experts must split into groups of at least 2"),
    ({"n_shared_experts": 0}, "field n_shared_experts = 0: converted with at least one shared expert"),
    ({"moe_layer_freq": 2}, "field moe_layer_freq = 2 cannot be converted"),
    ({"first_k_dense_replace": 3}, "field first_k_dense_replace = 3 exceeds num_hidden_layers=2"),
    ({"num_key_value_heads": 2}, "field num_key_value_heads = 2 differs from num_attention_heads=4"),
    ({"attention_bias": True}, "field attention_bias = True cannot be converted"),
    ({"qk_rope_head_dim": 7}, "field qk_rope_head_dim = 7 is odd"),
    ({"routed_scaling_factor": None}, "field routed_scaling_factor = is missing"),
    ({"quantization_config": {"quant_method": "fp8"}}, "field quantization_config = quantized weights are not converted"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", REFUSED, ids=[f"{list(c)[0]}-{i}" for i, (c, _) in enumerate(REFUSED)])
def test_settings_that_change_the_math_are_refused_by_name(tmp_path, change, message):
    data = {**config_dict("deepseek_v3"), **change}
    if "rope_scaling" in change:
        data.pop("rope_parameters")
    with pytest.raises(ConfigValidationError) as err:
        from_config_json(tmp_path, data)
    assert message in str(err.value) and f"{tmp_path}/config.json" in str(err.value)


def test_q_lora_rank_must_be_given(tmp_path):
    data = config_dict("deepseek_v3_plain")
    del data["q_lora_rank"]
    with pytest.raises(ConfigValidationError, match="field q_lora_rank = is missing"):
        from_config_json(tmp_path, data)


def test_rotary_row_layout_follows_rope_interleave(tmp_path):
    """The same weights read with rope_interleave true and false are different models for
    transformers; ours computes each (megatron-core's MLA rotates interleaved pairs, so the rows
    stored in halves are permuted on the way in)."""
    directory = save_tiny("deepseek_v3", str(tmp_path / "hf"))
    tokens = random_tokens(256)
    halves = hf_logits(directory, tokens)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "rope_interleave": True}))
    pairs = hf_logits(directory, tokens)
    assert (halves - pairs).abs().max().item() > 1e-2
    assert (megatron_logits(directory, tokens)[..., :256] - pairs).abs().max().item() < 1e-4


@pytest.mark.timeout(400)
def test_multi_token_prediction_layers_are_left_out_and_the_expert_bias_stays_fp32(tmp_path, caplog):
    """A checkpoint with its multi-token-prediction layer (stored as the layer after the last):
    the import leaves it out with one log line; the export holds every other tensor bit for bit,
    says num_nextn_predict_layers 0, and loads in transformers. A bf16 export writes the expert
    bias in fp32, as transformers keeps it."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from megatron_bridge.cli.main import main

    source = save_tiny("deepseek_v3_plain", str(tmp_path / "hf"), max_shard_size="100KB")
    original = read_all(source)
    mtp = {name.replace("model.layers.1.", "model.layers.2."): t.clone() for name, t in original.items()
           if name.startswith("model.layers.1.")}  # fmt: skip
    mtp.update({"model.layers.2.eh_proj.weight": torch.randn(64, 128), "model.layers.2.enorm.weight": torch.ones(64)})
    save_file(mtp, str(tmp_path / "hf" / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in mtp})
    index_path.write_text(json.dumps(index))
    config_path = tmp_path / "hf" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "num_nextn_predict_layers": 1}))

    ckpt, out, bf16 = (str(tmp_path / d) for d in ("ckpt", "exported", "bf16"))
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        assert main(["hf", "import", source, ckpt]) == 0
    skipped = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(skipped) == 1 and f"{len(mtp)} tensors (model.layers.2.*) left out" in skipped[0]
    assert "multi-token-prediction layers are not converted" in skipped[0]
    assert main(["hf", "export", ckpt, out]) == 0
    assert_bit_identical(original, read_all(out))
    assert json.loads(open(os.path.join(out, "config.json")).read())["num_nextn_predict_layers"] == 0
    tokens = random_tokens(256)
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(out)(tokens).logits, hf_logits(source, tokens))

    assert main(["hf", "export", ckpt, bf16, "--dtype", "bf16"]) == 0
    exported = read_all(bf16)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert exported[bias].dtype == torch.float32 and torch.equal(exported[bias], original[bias])
    assert all(t.dtype == torch.bfloat16 for name, t in exported.items() if name != bias)


@pytest.mark.parametrize(
    "config, provider, published",
    [
        (dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
              num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
              n_routed_experts=256, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
              qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3),
         M.DeepSeekV3ModelProvider, 671e9),
        (dict(vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
              num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
              n_routed_experts=64, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
              qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=6, first_k_dense_replace=1),
         M.MoonlightModelProvider16B, 16e9),
    ],
    ids=["deepseek-v3-671b", "moonlight-16b-a3b"],
)  # fmt: skip
def test_parameter_counts_are_those_of_the_published_models(config, provider, published):
    """The planner's count equals transformers' model built (on the meta device) from the
    published config (no vocabulary padding: both vocabularies are multiples of 128), and the
    published size within 1% (DeepSeek-V3: 671B without the 14B multi-token-prediction layer)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with torch.device("meta"):
        hf_count = sum(p.numel() for p in DeepseekV3ForCausalLM(DeepseekV3Config(**config)).parameters())
    count = count_parameters(provider())
    assert count.total == hf_count
    assert abs(count.total - published) < 0.01 * published


def test_mlp_and_shared_expert_adapters_export_onto_their_hugging_face_modules():
    """Dense MLPs and shared experts: [gate; up] rows split onto gate_proj and up_proj. (peft 0.21
    with transformers 5 re-targets adapters named gate_proj/up_proj/down_proj in DeepSeek-V3
    models onto the fused routed experts, so it cannot load these; the names are transformers'.)"""
    from factories import tiny_deepseek_model

    from megatron_bridge.peft.export import to_peft_state

    rows = torch.arange(64.0).unsqueeze(1)  # 32 gate rows, then 32 up rows
    state = to_peft_state(
        {
            "decoder.layers.1.mlp.shared_experts.linear_fc1.lora_B": rows,
            "decoder.layers.1.mlp.shared_experts.linear_fc2.lora_A": torch.ones(4, 32),
            "decoder.layers.0.mlp.linear_fc1.lora_B": torch.arange(192.0).unsqueeze(1),
            "decoder.layers.0.self_attention.linear_kv_up_proj.lora_B": torch.ones(112, 4),
        },
        tiny_deepseek_model(),
    )
    shared = "base_model.model.model.layers.1.mlp.shared_experts."
    assert state[shared + "gate_proj.lora_B.weight"][:, 0].tolist() == list(range(32))
    assert state[shared + "up_proj.lora_B.weight"][:, 0].tolist() == list(range(32, 64))
    assert torch.equal(state[shared + "down_proj.lora_A.weight"], torch.ones(4, 32))
    assert state["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"][:, 0].tolist() == list(range(96, 192))
    assert state["base_model.model.model.layers.0.self_attn.kv_b_proj.lora_B.weight"].shape == (112, 4)


def test_lora_adapters_on_latent_attention_load_in_peft_with_our_logits(tmp_path):
    """LoRA on every MLA projection (the rotary rows of q_b_proj and kv_a_proj_with_mqa stored in
    halves: the adapters' rows are put in that order) and the output projection; `peft` puts the
    exported adapters on transformers' model and computes our adapted logits."""
    import peft
    from transformers import AutoModelForCausalLM

    from megatron_bridge.cli.main import main
    from megatron_bridge.peft import LoRA
    from megatron_bridge.peft.merge import read_adapter_checkpoint
    from megatron_bridge.peft.offline import load_weights, single_process_model
    from megatron_bridge.training.config import CheckpointConfig, TrainingConfig, ValidationConfig
    from megatron_bridge.training.finetune import finetune
    from megatron_bridge.training.gpt_step import forward_step

    source, base, run, adapters = (str(tmp_path / d) for d in ("hf", "base", "lora", "adapters"))
    save_tiny("deepseek_v3", source)
    assert main(["hf", "import", source, base]) == 0
    model = GPTModelProvider.from_hf(source)
    model.seq_length = 32
    cfg = tiny_config(
        model=model,
        train=TrainingConfig(train_iters=2, global_batch_size=4, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        checkpoint=CheckpointConfig(pretrained_checkpoint=base, save=run),
    )
    targets = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    cfg.peft = LoRA(dim=4, alpha=8, lora_B_init_method="kaiming", target_modules=targets)
    finetune(cfg, forward_step)
    assert main(["peft", "export", run, adapters]) == 0
    written = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert set(written["target_modules"]) == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}

    tokens = random_tokens(256)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    directory, _, run_cfg, _ = read_adapter_checkpoint(run)
    with single_process_model(run_cfg) as ours:
        load_weights(ours, base, "base")
        load_weights(ours, directory, "adapters")
        with torch.no_grad():
            adapted = ours(tokens, positions, None)
    hf_base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = hf_base(tokens).logits
        theirs = peft.PeftModel.from_pretrained(hf_base, adapters).eval()(tokens).logits
    assert (adapted[..., :256] - plain).abs().max().item() > 1e-2  # the adapters change the logits
    assert (theirs - adapted[..., :256]).abs().max().item() < 1e-4


@pytest.mark.timeout(400)
def test_eval_loss_and_greedy_tokens_are_those_of_transformers(tmp_path):
    """`mbridge eval` (a fresh process) on the Hugging Face directory gives transformers' mean
    next-token loss, and `generate()` its greedy tokens (MLA with YaRN and group-limited routing,
    KV cache)."""
    import concurrent.futures

    from inference_models import hf_tokenizer, mbridge, tiny_hf_model, transformers_logprobs, transformers_model
    from text_data import documents, write_jsonl

    from megatron_bridge.inference import generate

    model = tiny_hf_model("deepseek_v3", tmp_path / "hf")
    docs = documents(6, seed=7, sentences=(1, 4))
    data = str(tmp_path / "docs.jsonl")
    write_jsonl(data, [{"text": d} for d in docs])
    prompts = ["The cat sees", "A farmer builds a green house"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        cli = pool.submit(mbridge, "eval", model, "--data", data, "--json")
        out = generate(model, prompts, max_new_tokens=12, ignore_eos=True)
        proc = cli.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    hf, tok = transformers_model(model), hf_tokenizer(model)
    # each document truncated to the model's sequence length, as eval does by default
    encoded = [tok.encode(d).ids[: family_configs()["deepseek_v3"].max_position_embeddings] for d in docs]
    loss = -sum(transformers_logprobs(hf, ids).sum().item() for ids in encoded)
    count = sum(len(ids) - 1 for ids in encoded)
    assert result["tokens"] == count and abs(result["loss"] - loss / count) / (loss / count) < 1e-4
    for prompt, got in zip(prompts, out):
        ids = torch.tensor([tok.encode(prompt).ids])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert got.token_ids == expected[0, ids.shape[1] :].tolist()
