"""GPT-OSS through the Hugging Face bridge, piece by piece: config.json both ways and the window
pattern, refusals by field, YaRN and attention sinks against transformers' own functions, the
stacked expert tensors, the provider checks, parameter counts of the published models, and
LoRA adapters that `peft` loads. Logits, round trips, TP2 and EP2 are in test_hf_weights /
test_hf_parallel (the tiny `gpt_oss` family config)."""

from __future__ import annotations

import json

import pytest
import torch
from factories import one_process_group, tiny_config
from hf_models import family_configs, random_tokens, save_tiny

from megatron_bridge import models as M
from megatron_bridge.config.errors import ConfigValidationError, Problems
from megatron_bridge.models import GPTModelProvider, count_parameters
from megatron_bridge.models.hf import mapping
from megatron_bridge.models.hf.config import architecture_differences, hf_config_from_provider, provider_from_hf_config
from megatron_bridge.models.hf.stacked import ExpertSlice
from megatron_bridge.training import cpu_backend

pytestmark = pytest.mark.timeout(300)


def config_dict(**changes) -> dict:
    return {**family_configs()["gpt_oss"].to_dict(), "architectures": ["GptOssForCausalLM"], **changes}


def from_config_json(tmp_path, data: dict):
    (tmp_path / "config.json").write_text(json.dumps(data))
    return GPTModelProvider.from_hf(str(tmp_path))


# ---------------------------------------------------------------------- config.json
def test_from_hf_sets_sinks_window_pattern_yarn_and_the_clamped_experts(tmp_path):
    p = from_config_json(tmp_path, config_dict())
    assert type(p) is M.GptOssModelProvider
    assert p.softmax_type == "learnable" and p.add_bias_linear and p.window_size == (3, 0)
    assert p.window_attn_skip_freq == 2  # layer 1 sliding, layer 2 full
    assert (p.activation_func_clamp_value, p.glu_linear_offset, p.activation_func.__name__) == (7.0, 1.0, "quick_gelu")
    assert p.position_embedding_type == "yarn" and p.yarn_rotary_scaling_factor == 4.0
    assert (p.yarn_beta_fast, p.yarn_original_max_position_embeddings, p.yarn_correction_range_round_to_int) == (8.0, 64, False)
    assert (p.num_moe_experts, p.moe_router_topk, p.moe_ffn_hidden_size, p.kv_channels) == (4, 2, 48, 16)
    p.finalize()
    plain = from_config_json(tmp_path, config_dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert plain.position_embedding_type == "rope" and plain.yarn_rotary_scaling_factor == 1.0
    plain.finalize()  # no YaRN field left set without YaRN


@pytest.mark.parametrize(
    "layer_types, window, freq",
    [
        (["sliding_attention", "full_attention", "sliding_attention", "full_attention"], (3, 0), 2),
        (["full_attention", "sliding_attention", "sliding_attention", "full_attention"], (3, 0), [0, 1, 1, 0]),
        (["sliding_attention"] * 4, (3, 0), None),
        (["full_attention"] * 4, None, None),
    ],
    ids=["alternating", "pattern", "all-sliding", "all-full"],
)
def test_window_patterns_round_trip_through_config_json(tmp_path, layer_types, window, freq):
    from transformers import AutoConfig

    p = provider_from_hf_config(config_dict(num_hidden_layers=4, layer_types=layer_types), Problems())
    assert (p.window_size, p.window_attn_skip_freq) == (window, freq)
    p.finalize()
    written = hf_config_from_provider(p, "float32")
    assert written["layer_types"] == layer_types and written["rope_scaling"]["truncate"] is False
    again = provider_from_hf_config(written, Problems())
    assert not architecture_differences(again, p)
    for field in ("window_size", "window_attn_skip_freq", "rotary_base", "activation_func_clamp_value", "softmax_type",
                  "yarn_rotary_scaling_factor", "yarn_beta_fast", "yarn_beta_slow", "yarn_original_max_position_embeddings",
                  "yarn_correction_range_round_to_int"):  # fmt: skip
        assert getattr(again, field) == getattr(p, field), field
    (tmp_path / "config.json").write_text(json.dumps(written))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.layer_types == layer_types and loaded.swiglu_limit == 7.0
    assert loaded.rope_parameters["rope_type"] == "yarn" and loaded.rope_parameters["factor"] == 4.0


REFUSED = [
    ({"quantization_config": {"quant_method": "mxfp4"}},
     "field quantization_config = 'mxfp4': quantized expert weights are not converted", "dequantize to bf16 first"),
    ({"attention_bias": False}, "field attention_bias = False cannot be converted", "attention_bias=True"),
    ({"swiglu_alpha": 1.5}, "field swiglu_alpha = 1.5 (megatron-core's quick_gelu gate has the gain 1.702)", ""),
    ({"swiglu_limit": None}, "field swiglu_limit = None is not a positive clamp", ""),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "field layer_types = ['sliding_attention', 'chunked", ""),
    ({"layer_types": ["sliding_attention"]}, "field layer_types = lists 1 layers, num_hidden_layers=2", ""),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "field rope_parameters.rope_type = 'dynamic' is not implemented (default and yarn are)", ""),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 16,
                          "attention_factor": 1.0}},
     "field rope_parameters.attention_factor = 1.0: megatron-core scales cos and sin by the factor YaRN computes", ""),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 0.5, "rope_theta": 1e4, "original_max_position_embeddings": 16}},
     "field rope_parameters.factor = 0.5 is below 1", ""),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 16,
                          "partial_rotary_factor": 0.5}},
     "field partial_rotary_factor = 0.5: megatron-core's YaRN rotates whole heads", ""),
    ({"num_experts_per_tok": 1}, "field num_experts_per_tok = 1 cannot be converted (transformers weighs the one expert",
     "convert a model choosing more than one expert"),
]  # fmt: skip


@pytest.mark.parametrize("change, message, fix", REFUSED, ids=[f"{list(c)[0]}-{i}" for i, (c, _, _) in enumerate(REFUSED)])
def test_settings_that_change_the_math_are_refused_by_name(tmp_path, change, message, fix):
    with pytest.raises(ConfigValidationError) as err:
        from_config_json(tmp_path, config_dict(**change))
    assert message in str(err.value) and fix in str(err.value) and f"{tmp_path}/config.json" in str(err.value)


def test_providers_that_gpt_oss_cannot_express_are_not_written_as_another_family():
    """Sinks, a clamp, an offset GLU or a window pattern have no counterpart in the Llama-style
    families: such a provider is written as GPT-OSS or not at all."""
    from megatron_bridge.models.hf.registry import family_of_provider

    assert family_of_provider(M.GptOssModelProvider20B()).architecture == "GptOssForCausalLM"
    for change, field in (({"softmax_type": "learnable"}, "softmax_type"),
                          ({"activation_func_clamp_value": 7.0}, "activation_func_clamp_value"),
                          ({"glu_linear_offset": 1.0}, "glu_linear_offset"),
                          ({"window_size": (127, 0), "window_attn_skip_freq": 2}, "window_attn_skip_freq")):  # fmt: skip
        problems = Problems()
        assert family_of_provider(M.MistralModelProvider(**change), problems) is None, change
        assert [p.path for p in problems] == [f"model.{field}"]


# ---------------------------------------------------------------------- provider checks
def test_provider_checks_name_the_field():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    cases = [
        ({**no_yarn(), "position_embedding_type": "rope", "yarn_beta_fast": 16.0},
         "yarn_beta_fast: 16.0 applies to YaRN only, but position_embedding_type='rope'"),
        (dict(rotary_percent=0.5), "rotary_percent: 0.5 is not applied with position_embedding_type='yarn'"),
        (dict(bias_activation_fusion=True),
         "bias_activation_fusion: True with activation_func_clamp_value=7.0: megatron-core's fused kernel clamps only "
         "with its quick_gelu"),
        (dict(bias_activation_fusion=True, activation_func=quick_gelu),
         "bias_activation_fusion: True with activation_func_clamp_value=7.0: megatron-core's fused kernel clamps "
         "before adding the bias"),
        (dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=2),
         "expert_tensor_parallel_size: 2: megatron-core splits no expert with biases"),
    ]  # fmt: skip
    for change, message in cases:
        with pytest.raises(ConfigValidationError) as err:
            M.GptOssModelProvider(num_layers=2, num_moe_experts=4, **change).finalize()
        assert message in str(err.value), str(err.value)
    derived = M.GptOssModelProvider(num_layers=2, num_moe_experts=4, tensor_model_parallel_size=2)
    derived.finalize()
    assert derived.expert_tensor_parallel_size == 1 and "expert_tensor_parallel_size" in derived.derived_fields()


def no_yarn():
    from megatron_bridge.models.hf.yarn import no_yarn as defaults

    return defaults()


# ---------------------------------------------------------------------- YaRN and sinks against transformers
@pytest.mark.parametrize(
    "rope",
    [
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096, truncate=False),
        dict(factor=4.0, beta_fast=8.0, beta_slow=1.0, original_max_position_embeddings=64),  # truncate: True
        dict(factor=8.0, original_max_position_embeddings=512, mscale=1.0, mscale_all_dim=0.707),
    ],
    ids=["gpt-oss", "truncated", "mscale-ratio"],
)
def test_yarn_cos_and_sin_are_those_of_transformers(rope):
    """megatron-core's YaRN embedding built from our provider fields, its attention factor
    included, against transformers' rotary embedding of the same config.json."""
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **rope}
    hf_config = GptOssConfig(head_dim=64, hidden_size=256, num_attention_heads=4, max_position_embeddings=4096,
                             rope_parameters=params)  # fmt: skip
    p = provider_from_hf_config(config_dict(head_dim=64, rope_parameters=params), Problems())
    with cpu_backend.active():  # megatron-core moves the frequencies to the GPU (the CPU on a CPU machine)
        ours = YarnRotaryEmbedding(
            kv_channels=64, rotary_base=p.rotary_base, scaling_factor=p.yarn_rotary_scaling_factor,
            original_max_position_embeddings=p.yarn_original_max_position_embeddings, beta_fast=p.yarn_beta_fast,
            beta_slow=p.yarn_beta_slow, mscale=p.yarn_mscale, mscale_all_dim=p.yarn_mscale_all_dim,
            correction_range_round_to_int=p.yarn_correction_range_round_to_int, use_cpu_initialization=True,
        )  # fmt: skip
        emb, _ = ours.get_emb(300)
    factor = _yarn_get_concentration_factor_from_config(p)  # what the attention layers put on cos and sin
    theirs = GptOssRotaryEmbedding(hf_config)
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), torch.arange(300).unsqueeze(0))
    assert theirs.attention_scaling != 1.0
    # on the GPU where there is one: its frequencies differ in the last bit, positions multiply that
    tolerance = 1e-6 if emb.device.type == "cpu" else 1e-4
    emb = emb.cpu()
    assert torch.allclose(torch.cos(emb[:, 0, 0, :32]) * factor, cos[0], rtol=0, atol=tolerance)
    assert torch.allclose(torch.sin(emb[:, 0, 0, :32]) * factor, sin[0], rtol=0, atol=tolerance)


@pytest.fixture
def model_parallel():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with one_process_group(), cpu_backend.active():
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(3)
        yield
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("layer, packed", [(1, False), (2, False), (1, True)], ids=["window", "full", "window-packed"])
@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_attention_sinks_are_those_of_transformers(model_parallel, layer, packed, backend):
    """The core attention the GPT-OSS layer spec builds (SDPA with the sink key, or megatron-core's
    unfused attention with a learned softmax offset; layer 1 with a 4-token window, layer 2
    without) against transformers' eager GPT-OSS attention with the same sinks and mask; packed
    samples stay apart."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from megatron_bridge.models.attention import core_attention_choice, core_attention_module

    heads, groups, dim, seq = 4, 2, 16, 12
    config = M.GptOssModelProvider(num_layers=2, hidden_size=64, num_attention_heads=heads, num_query_groups=groups,
                                   kv_channels=dim, num_moe_experts=4, window_size=(3, 0), seq_length=seq,
                                   attention_backend=AttnBackend[backend], **cpu_backend.CPU_MODEL_SETTINGS)  # fmt: skip
    config.finalize()
    choice = core_attention_choice(config)
    assert choice.kind == ("sdpa" if backend == "auto" else "unfused")
    module_cls = core_attention_module(config, choice) or DotProductAttention
    attention = module_cls(config, layer, AttnMaskType.causal, "self")
    device = attention.softmax_offset.device  # the GPU where there is one
    with torch.no_grad():
        attention.softmax_offset.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0]))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(seq, 2, n, dim, generator=gen) for n in (heads, groups, groups))
    i, j = torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1)
    allowed = (j <= i) & ((j > i - 4) if layer == 1 else True)
    blocked = None
    if packed:  # samples of 5 and 7 tokens in one sequence
        same = (i < 5) == (j < 5)
        allowed = allowed & same
        blocked = (~same).view(1, 1, seq, seq)
    on_device = (x.to(device) for x in (q, k, v))
    ours = attention(*on_device, None if blocked is None else blocked.to(device)).view(seq, 2, heads, dim).cpu()

    class Sinks(torch.nn.Module):
        num_key_value_groups = heads // groups
        sinks = attention.softmax_offset.detach().cpu()

    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min).view(1, 1, seq, seq)
    theirs, _ = eager_attention_forward(Sinks().eval(), *(x.permute(1, 2, 0, 3) for x in (q, k, v)), mask, dim**-0.5)
    tolerance = 1e-6 if device.type == "cpu" else 2e-4  # fp32; GPU kernels sum in other orders (TF32 too)
    assert (ours - theirs.transpose(0, 1)).abs().max().item() < tolerance  # [b, s, h, d] -> [s, b, h, d]


# ---------------------------------------------------------------------- stacked experts
def test_stacked_expert_slices_deinterleave_and_split_per_rank(tmp_path):
    """gate_up_proj [experts, in, 2 x ffn] alternates gate and up columns; megatron-core's
    linear_fc1 of expert E is [gate rows; up rows], each tensor-parallel rank holding its gate and
    its up rows. Slices come back bit-identical."""
    from safetensors.torch import save_file

    from megatron_bridge.models.hf.reader import SafetensorsReader

    experts, hidden, ffn = 3, 5, 4
    gate_up = torch.randn(experts, hidden, 2 * ffn)
    down = torch.randn(experts, ffn, hidden)
    save_file({"gate_up": gate_up, "down": down}, str(tmp_path / "model.safetensors"))
    reader = SafetensorsReader(str(tmp_path))
    fc1 = ExpertSlice("gate_up", 2, experts, transposed=True, interleaved=True, gated=True)
    fc2 = ExpertSlice("down", 1, experts, transposed=True)
    whole = torch.empty(2 * ffn, hidden)
    fc1.load(reader, whole, mapping.Partition())
    assert torch.equal(whole[:ffn], gate_up[2, :, 0::2].t()) and torch.equal(whole[ffn:], gate_up[2, :, 1::2].t())
    for size in (1, 2):
        rows = [torch.empty(2 * ffn // size, hidden) for _ in range(size)]
        for rank, dest in enumerate(rows):
            fc1.load(reader, dest, mapping.Partition(0, rank, size))
        half = ffn // size
        assert torch.equal(rows[-1], torch.cat([whole[ffn - half : ffn], whole[2 * ffn - half :]]))
        assert torch.equal(fc1.to_hf(rows, mapping.Partition(0, 0, size))["gate_up"], gate_up[2])
        cols = [torch.empty(hidden, ffn // size) for _ in range(size)]  # row-parallel fc2: input columns split
        for rank, dest in enumerate(cols):
            fc2.load(reader, dest, mapping.Partition(1, rank, size))
        assert torch.equal(torch.cat(cols, dim=1), down[1].t())
        assert torch.equal(fc2.to_hf(cols, mapping.Partition(1, 0, size))["down"], down[1])
    assert fc1.hf_shapes((2 * ffn, hidden)) == {"gate_up": (experts, hidden, 2 * ffn)} and fc1.stack_index == (2, 3)


# ---------------------------------------------------------------------- published sizes
@pytest.mark.parametrize(
    "layers, experts, provider, published",
    [(24, 32, M.GptOssModelProvider20B, 20.91e9), (36, 128, M.GptOssModelProvider120B, 116.83e9)],
    ids=["20b", "120b"],
)
def test_parameter_counts_are_those_of_the_published_models(layers, experts, provider, published):
    """The planner's count (sinks and biases included) equals the transformers model built on
    the meta device from the published config (vocabulary 201088 needs no padding)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)
    with torch.device("meta"):
        hf_count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert count_parameters(provider()).total == hf_count
    assert abs(hf_count - published) < 0.01 * published


# ---------------------------------------------------------------------- LoRA -> peft
def test_lora_adapters_on_the_attention_load_in_peft_with_our_logits(tmp_path):
    """Import the Hugging Face model, train LoRA adapters on the attention projections (B starts
    non-zero, so they matter), export them: `peft` puts them on transformers' model of the same
    directory and computes our adapted model's logits."""
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
    save_tiny("gpt_oss", source)
    assert main(["hf", "import", source, base]) == 0
    model = GPTModelProvider.from_hf(source)
    model.seq_length = 32
    cfg = tiny_config(
        model=model,
        train=TrainingConfig(train_iters=2, global_batch_size=4, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        checkpoint=CheckpointConfig(pretrained_checkpoint=base, save=run),
    )
    cfg.peft = LoRA(dim=4, alpha=8, lora_B_init_method="kaiming", target_modules=["linear_qkv", "linear_proj"])
    finetune(cfg, forward_step)
    assert main(["peft", "export", run, adapters]) == 0
    written = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert set(written["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}

    tokens = random_tokens(family_configs()["gpt_oss"].vocab_size)
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
    assert (adapted - plain).abs().max().item() > 1e-2  # the adapters change the logits
    assert (theirs - adapted).abs().max().item() < 1e-4


def test_grouped_experts_with_biases_need_transformer_engines_grouped_gemm():
    """megatron-core's legacy GroupedMLP (the grouped_gemm package without TransformerEngine) has
    no expert biases: a default grouped GEMM gives way to sequential experts, an explicit one is
    refused; TransformerEngine's grouped layers take the biases."""
    from megatron_bridge.models.experts import decide_grouped_gemm

    default, explicit = M.GptOssModelProvider20B(), M.GptOssModelProvider20B(moe_grouped_gemm=True)
    assert decide_grouped_gemm(default, te_layers=True, grouped_gemm_installed=True).grouped_gemm is True
    falls_back = decide_grouped_gemm(default, te_layers=False, grouped_gemm_installed=True)
    assert falls_back.grouped_gemm is False and "(GroupedMLP) has no expert biases" in falls_back.message
    refused = decide_grouped_gemm(explicit, te_layers=False, grouped_gemm_installed=True)
    assert refused.refused and "moe_grouped_gemm=True needs a grouped GEMM, but megatron-core's" in refused.message


# ---------------------------------------------------------------------- eval and generate
def test_eval_loss_and_greedy_tokens_are_those_of_transformers(tmp_path):
    """`evaluate()` on the Hugging Face directory gives transformers' mean next-token loss, and
    `generate()` its greedy tokens (KV cache; sinks, the window of 4 and YaRN at every step)."""
    from inference_models import hf_tokenizer, tiny_hf_model, transformers_logprobs, transformers_model
    from text_data import documents, write_jsonl

    from megatron_bridge.inference import evaluate, generate

    model = tiny_hf_model("gpt_oss", tmp_path / "hf")
    docs = documents(6, seed=7, sentences=(1, 4))
    write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    hf, tok = transformers_model(model), hf_tokenizer(model)
    total = count = 0
    for doc in docs:  # each truncated to the model's sequence length, as evaluate() does by default
        ids = tok.encode(doc).ids[: family_configs()["gpt_oss"].max_position_embeddings]
        total -= transformers_logprobs(hf, ids).sum().item()
        count += len(ids) - 1
    result = evaluate(model, str(tmp_path / "docs.jsonl"))
    assert result.tokens == count and abs(result.loss - total / count) / (total / count) < 1e-4
    prompts = ["The cat sees", "A farmer builds a green house"]
    out = generate(model, prompts, max_new_tokens=12, ignore_eos=True)
    for prompt, got in zip(prompts, out):
        ids = torch.tensor([tok.encode(prompt).ids])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert got.token_ids == expected[0, ids.shape[1] :].tolist()
