"""Gemma 2 and Gemma 3 through the Hugging Face bridge: config.json both ways (the transformers 4
and 5 layouts), refusals by field, the provider's checks of the Gemma layer fields, the layer
modules against transformers' own, the published sizes, and LoRA adapters that `peft` loads.
Logits against transformers, bit-identical round trips and TP2 loads are in test_hf_weights and
test_hf_parallel (parametrized over every tiny family, Gemma 2 and 3 included)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import family_configs

from megatron_bridge import models as M
from megatron_bridge.config.errors import ConfigValidationError, Problems
from megatron_bridge.models import GPTModelProvider, count_parameters
from megatron_bridge.models.gemma import is_gelu_tanh
from megatron_bridge.models.hf.config import architecture_differences, hf_config_from_provider, provider_from_hf_config

pytestmark = pytest.mark.timeout(300)
ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}


def config_dict(name: str) -> dict:
    return {**family_configs()[name].to_dict(), "architectures": [ARCHITECTURES[name]]}


def legacy_gemma3(**change) -> dict:
    """The tiny Gemma 3 as a transformers 4 config.json writes it: rope_theta, rope_scaling (the
    global layers), rope_local_base_freq, sliding_window_pattern instead of layer_types."""
    cfg = {k: v for k, v in config_dict("gemma3").items() if k not in ("rope_parameters", "layer_types")}
    cfg.update(rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=2)  # fmt: skip
    return {**cfg, **change}


def provider_of(data: dict, problems=None):
    problems = problems if problems is not None else Problems()
    provider = provider_from_hf_config(data, problems)
    problems.raise_if_any()
    return provider


def from_config_json(tmp_path, data: dict):
    (tmp_path / "config.json").write_text(json.dumps(data))
    return GPTModelProvider.from_hf(str(tmp_path))


GEMMA3_FIELDS = dict(
    window_size=(3, 0), window_attn_skip_freq=2, rotary_base=1_000_000, local_rotary_base=10000,
    seq_len_interpolation_factor=8.0, softmax_scale=24**-0.5, kv_channels=32, layernorm_zero_centered_gamma=True,
    scale_embeddings=True, input_layernorms=True, output_layernorms=True, qk_layernorm=True,
    qk_layernorm_per_head=True, share_embeddings_and_output_weights=True, attention_logit_softcap=None,
    output_logit_softcap=None, transformer_impl="local", layernorm_epsilon=1e-6,
)  # fmt: skip


def test_gemma3_reads_the_transformers_5_and_4_layouts_alike(tmp_path):
    for data in (config_dict("gemma3"), legacy_gemma3()):
        p = from_config_json(tmp_path, data)
        assert type(p) is M.Gemma3ModelProvider and is_gelu_tanh(p.activation_func)
        assert {k: getattr(p, k) for k in GEMMA3_FIELDS} == GEMMA3_FIELDS
        assert p.scale_embeddings and p.layernorm_zero_centered_gamma and p.local_rotary_base == 10000
        p.finalize()
    # the published pattern (5 window layers per global one) as megatron-core's every-Nth rule,
    # any other one per layer; no window layer: no window and no local base
    assert provider_of(legacy_gemma3(num_hidden_layers=8, sliding_window_pattern=6)).window_attn_skip_freq == 6
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    odd = provider_of({**config_dict("gemma3"), "num_hidden_layers": 3, "layer_types": types})
    assert odd.window_attn_skip_freq == [0, 1, 1]
    full = provider_of({**config_dict("gemma3"), "layer_types": ["full_attention"] * 2})
    assert full.window_size is None and full.local_rotary_base is None
    full.finalize()


def test_gemma2_reads_caps_windows_and_one_rope_base():
    p = provider_of(config_dict("gemma2"))
    assert type(p) is M.Gemma2ModelProvider and not p.qk_layernorm and p.local_rotary_base is None
    assert (p.attention_logit_softcap, p.output_logit_softcap) == (2.0, 3.0)
    assert (p.window_size, p.window_attn_skip_freq, p.rotary_base) == ((3, 0), 2, 10000)
    # absent caps are transformers' Gemma 2 defaults, not "no cap"
    data = {k: v for k, v in config_dict("gemma2").items() if not k.endswith("softcapping")}
    assert (provider_of(data).attention_logit_softcap, provider_of(data).output_logit_softcap) == (50.0, 30.0)


@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_provider_to_config_json_and_back(tmp_path, name):
    from transformers import AutoConfig

    provider = provider_of(config_dict(name))
    provider.finalize()
    written = hf_config_from_provider(provider, "float32")
    assert written["architectures"] == [ARCHITECTURES[name]]
    again = provider_of(written)
    assert type(again) is type(provider) and not architecture_differences(again, provider)
    for field in ("rotary_base", "local_rotary_base", "seq_len_interpolation_factor", "window_size",
                  "window_attn_skip_freq", "softmax_scale", "attention_logit_softcap", "output_logit_softcap"):  # fmt: skip
        assert getattr(again, field) == getattr(provider, field), field
    (tmp_path / "config.json").write_text(json.dumps(written))
    loaded, original = AutoConfig.from_pretrained(tmp_path), family_configs()[name]
    for attr in ("rope_parameters", "layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim",
                 "hidden_activation", "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings"):  # fmt: skip
        assert getattr(loaded, attr) == getattr(original, attr), attr


# published text decoders (model cards' config.json) -> (size provider, text parameters of the
# Gemma 3 report: embedding + non-embedding; the 4B and 27B releases add a 417M vision encoder)
PUBLISHED = {
    "1b": (dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=32768,
                query_pre_attn_scalar=256, rope_scaling=None), M.Gemma3ModelProvider1B, 1.000e9),
    "4b": (dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                num_key_value_heads=4, head_dim=256, sliding_window=1024, max_position_embeddings=131072,
                query_pre_attn_scalar=256, rope_scaling={"rope_type": "linear", "factor": 8.0}),
           M.Gemma3ModelProvider4B, 3.884e9),
    "27b": (dict(vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                 num_attention_heads=32, num_key_value_heads=16, head_dim=128, sliding_window=1024,
                 max_position_embeddings=131072, query_pre_attn_scalar=168,
                 rope_scaling={"rope_type": "linear", "factor": 8.0}), M.Gemma3ModelProvider27B, 27.016e9),
}  # fmt: skip


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_sizes_are_the_published_models(size):
    """The size providers are what config.json of the released model converts to, and the
    planner's count is transformers' model of it (built on the meta device) plus the rows that
    pad the vocabulary, within 1% of the published size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields, provider_cls, published = PUBLISHED[size]
    legacy = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", rope_theta=1e6,
                  rope_local_base_freq=10000.0, sliding_window_pattern=6, rms_norm_eps=1e-6, **fields)  # fmt: skip
    converted, ours = provider_of(legacy), provider_cls()
    assert not architecture_differences(converted, ours)
    for name in ("window_size", "window_attn_skip_freq", "local_rotary_base", "rotary_base", "softmax_scale",
                 "seq_len_interpolation_factor", "seq_length"):  # fmt: skip
        assert getattr(converted, name) == getattr(ours, name) or (name == "softmax_scale" and ours.softmax_scale
                                                                  is None and converted.softmax_scale == 1 / 16), name
    with torch.device("meta"):
        config = AutoConfig.for_model(**{k: v for k, v in legacy.items() if k != "architectures"})
        hf_count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    padding = (ours.padded_vocab_size() - ours.vocab_size) * ours.hidden_size  # tied: one embedding
    assert count_parameters(ours).total == hf_count + padding
    assert abs(count_parameters(ours).total - published) < 0.01 * published


REFUSED = [
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "field rope_parameters.full_attention.rope_type = 'yarn' is not implemented for the global layers"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "field rope_parameters.sliding_attention.rope_type = 'linear' is not implemented for the sliding-window layers"),
    ("legacy", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "field rope_scaling.rope_type = 'dynamic' is not implemented"),
    ("legacy", {"rope_local_base_freq": 10000.5}, "field rope_local_base_freq = 10000.5 is not a positive whole number"),
    ("gemma3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "field rope_parameters = {'rope_type': 'default', 'rope_theta': 10000.0}: Gemma 3 sets RoPE per layer type"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "field attn_logit_softcapping = 50.0: transformers' Gemma 3 does not apply it"),
    ("gemma3", {"hidden_activation": "gelu"}, "field hidden_activation = 'gelu' is not converted (gelu_pytorch_tanh is)"),
    ("gemma3", {"use_bidirectional_attention": True}, "field use_bidirectional_attention = True cannot be converted"),
    ("gemma3", {"layer_types": ["sliding_attention", "local"]}, "field layer_types = ['sliding_attention', 'local'] is not one of"),
    ("gemma3", {"sliding_window": None}, "field sliding_window = None: layer_types has sliding_attention layers"),
    ("gemma2", {"final_logit_softcapping": -1.0}, "field final_logit_softcapping = -1.0 is not a positive number or null"),
    ("gemma2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "field rope_parameters.rope_type = 'yarn' is not implemented"),
]  # fmt: skip


@pytest.mark.parametrize("name, change, message", REFUSED, ids=[f"{n}-{list(c)[0]}-{i}" for i, (n, c, _) in enumerate(REFUSED)])
def test_settings_that_change_the_math_are_refused_by_name(tmp_path, name, change, message):
    data = legacy_gemma3(**change) if name == "legacy" else {**config_dict(name), **change}
    with pytest.raises(ConfigValidationError) as err:
        from_config_json(tmp_path, data)
    assert message in str(err.value) and f"{tmp_path}/config.json" in str(err.value)


SMALL = dict(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=96,
             vocab_size=256, seq_length=32, window_size=(3, 0), window_attn_skip_freq=3)  # fmt: skip


@pytest.mark.parametrize(
    "change, path, message",
    [
        (dict(window_size=None), "local_rotary_base", "applies to the sliding-window layers, but window_size is None"),
        (dict(context_parallel_size=2, tensor_model_parallel_size=1), "local_rotary_base",
         "is not implemented with context parallelism (context_parallel_size=2)"),
        (dict(position_embedding_type="learned_absolute"), "local_rotary_base", "needs rotary embeddings"),
        (dict(transformer_layer_spec="megatron_bridge.models.GPTModelProvider"), "local_rotary_base",
         "a custom transformer_layer_spec is built as given, without this setting"),
        (dict(attention_logit_softcap=30.0, transformer_impl="transformer_engine"), "attention_logit_softcap",
         "needs megatron-core's unfused core attention of local layers, but transformer_impl='transformer_engine'"),
        (dict(attention_logit_softcap=30.0, apply_query_key_layer_scaling=True, fp16=True), "attention_logit_softcap",
         "apply_query_key_layer_scaling divides them by the layer number first"),
        (dict(attention_logit_softcap=30.0, attention_backend="flash"), "attention_backend",
         "SDPA's, which cannot serve attention_logit_softcap (a cap on the scores before the softmax)"),
        (dict(normalization="LayerNorm"), "layernorm_zero_centered_gamma",
         "local layers have it for RMSNorm only, but normalization='LayerNorm'"),
    ],
    ids=["no-window", "cp", "no-rope", "custom-spec", "softcap-te", "softcap-layer-scaling", "softcap-flash", "layernorm"],
)  # fmt: skip
def test_gemma_layer_fields_are_checked_where_they_cannot_apply(change, path, message):
    from megatron.core.transformer.enums import AttnBackend

    if "attention_backend" in change:
        change = {**change, "attention_backend": AttnBackend[change["attention_backend"]]}
    provider = M.Gemma3ModelProvider(**{**SMALL, **change})
    with pytest.raises(ConfigValidationError) as err:
        provider.finalize()
    assert f"- {path}: " in str(err.value) and message in str(err.value)


def test_zero_centered_norm_computes_transformers_gemma_norm_bit_for_bit():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from megatron_bridge.models.layers.zero_centered_norm import ZeroCenteredRMSNorm

    ours, theirs = ZeroCenteredRMSNorm(None, 64, eps=1e-6), Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(0.3 * torch.randn(64))
        theirs.weight.copy_(ours.weight)
    for dtype in (torch.float32, torch.bfloat16):
        x = (3 * torch.randn(2, 5, 64)).to(dtype)
        a, b = ours.to(dtype)(x), theirs.to(dtype)(x)
        assert a.dtype == dtype and torch.equal(a, b)


def test_scaled_embeddings_round_the_factor_to_the_embedding_dtype():
    """sqrt(3072) = 55.4256 multiplies bf16 embeddings as 55.5, as in transformers' Gemma."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from megatron_bridge.models.layers.embedding_scale import scale_word_embeddings

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Module()
            self.embedding.word_embeddings = torch.nn.Embedding(10, 3072)

    model = Model()
    scale_word_embeddings(model, 3072)
    theirs = Gemma3TextScaledWordEmbedding(10, 3072, 0, embed_scale=3072**0.5)
    with torch.no_grad():
        theirs.weight.copy_(model.embedding.word_embeddings.weight)
    tokens = torch.arange(10).view(2, 5)
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype), theirs.to(dtype)
        out = model.embedding.word_embeddings(tokens)
        assert out.dtype == dtype and torch.equal(out, theirs(tokens))
    weight = model.embedding.word_embeddings.weight
    assert torch.equal(out[0, 1], weight[1] * torch.tensor(55.5, dtype=torch.bfloat16))


def test_window_layers_rotate_with_the_local_base_and_global_layers_with_the_model_table():
    """Layers 1 and 2 have the window (every 3rd layer is global): their attention swaps the
    model's table (base 1e6, positions / 8) for one of base 10000, equal to transformers' table
    of the sliding layers; one rotary module serves both."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from megatron_bridge.models.hf.runtime import build_chunks, model_parallel, prepare

    provider = M.Gemma3ModelProvider(**SMALL, seq_len_interpolation_factor=8.0)
    with model_parallel() as device:
        model = build_chunks(prepare(provider, device), device)[0]
        attention = [layer.self_attention for layer in model.decoder.layers]
        assert [a.local_rotary is not None for a in attention] == [True, True, False]
        assert attention[0].local_rotary is attention[1].local_rotary
        table = model.rotary_pos_emb(16)
        local = attention[0].local_rotary(table.shape[0])
    hf = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=3,
                          layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                          rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})  # fmt: skip
    rotary, x, positions = Gemma3RotaryEmbedding(hf), torch.zeros(1), torch.arange(16).unsqueeze(0)
    for ours, layer_type in ((local, "sliding_attention"), (table, "full_attention")):
        cos, sin = rotary(x, positions, layer_type)
        assert torch.allclose(ours.cpu().squeeze().cos(), cos[0], atol=1e-6) and torch.allclose(ours.cpu().squeeze().sin(), sin[0], atol=1e-6)
    assert not torch.allclose(local.cpu(), table.cpu())


@pytest.mark.timeout(400)
def test_eval_gives_the_loss_of_transformers(tmp_path):
    """`mbridge eval` (a fresh process) on the Gemma 3 directory and `evaluate()` (what it runs)
    on the Gemma 2 one: transformers' mean next-token loss of documents longer than the window
    (each truncated to the model's sequence length, as eval does by default)."""
    import concurrent.futures

    from inference_models import hf_tokenizer, mbridge, tiny_hf_model, transformers_logprobs, transformers_model
    from text_data import documents, write_jsonl

    from megatron_bridge.inference import evaluate

    docs = documents(6, seed=3, sentences=(2, 5))
    data = str(tmp_path / "docs.jsonl")
    write_jsonl(data, [{"text": d} for d in docs])
    models = {name: tiny_hf_model(name, tmp_path / name) for name in ("gemma3", "gemma2")}
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        cli = pool.submit(mbridge, "eval", models["gemma3"], "--data", data, "--json")
        ours = {"gemma2": evaluate(models["gemma2"], data)}
        proc = cli.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours["gemma3"] = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, result in ours.items():
        hf, tok, config = transformers_model(models[name]), hf_tokenizer(models[name]), family_configs()[name]
        encoded = [tok.encode(d).ids[: config.max_position_embeddings] for d in docs]
        assert max(len(ids) for ids in encoded) > 4 * config.sliding_window
        loss = -sum(transformers_logprobs(hf, ids).sum().item() for ids in encoded)
        count = sum(len(ids) - 1 for ids in encoded)
        tokens, mean = (result["tokens"], result["loss"]) if isinstance(result, dict) else (result.tokens, result.loss)
        assert tokens == count and abs(mean - loss / count) / (loss / count) < 1e-4, (name, mean, loss / count)
