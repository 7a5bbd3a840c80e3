"""Core attention of local layers: SDPA against megatron-core's unfused DotProductAttention
(module outputs and gradients, and 5 iterations of pretrain()), the choice between them and its
refusals, the recompute rule, and the expert MLP of MoE runs without a grouped GEMM."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from factories import one_process_group, tiny_config, tiny_llama_model, tiny_model
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType

from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.data.packing import block_causal_mask
from megatron_bridge.models.attention import core_attention_choice, core_attention_recompute
from megatron_bridge.models.attention_masks import WindowedDotProductAttention, blocked_outside_window
from megatron_bridge.models.sdpa_attention import SDPAttention
from megatron_bridge.runtime import cpu_backend

pytestmark = pytest.mark.timeout(300)

HEADS, GROUPS, DIM, SEQ = 4, 2, 16, 24
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = 1e-5 if DEVICE.type == "cpu" else 2e-4  # fp32; GPU kernels sum in other orders


@pytest.fixture(scope="module")
def model_parallel():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with one_process_group(), cpu_backend.active():
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(7)
        yield
        parallel_state.destroy_model_parallel()


def attention_config(**kw):
    args = dict(hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=GROUPS, seq_length=SEQ,
                attention_dropout=0.0, **cpu_backend.CPU_MODEL_SETTINGS)  # fmt: skip
    args.update(kw)
    config = tiny_model(**args)
    config.finalize()
    return config


def qkv(batch=2, seq=SEQ, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, HEADS, DIM, generator=gen)
    k = torch.randn(seq, batch, GROUPS, DIM, generator=gen)
    v = torch.randn(seq, batch, GROUPS, DIM, generator=gen)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def run(module, q, k, v, mask=None, **kw):
    """Output and gradients of q, k, v for a fixed output gradient (CPU copies)."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = module(q, k, v, None if mask is None else mask.to(DEVICE), **kw)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE))
    return tuple(x.detach().cpu() for x in (out, q.grad, k.grad, v.grad))


PACKED_POSITIONS = torch.tensor([list(range(10)) + list(range(9)) + list(range(5))] * 2)

CASES = {
    "causal": ({"num_query_groups": HEADS}, 1, False),
    "gqa": ({}, 1, False),
    "window": ({"window_size": (5, 0)}, 1, False),
    "window, packed": ({"window_size": (3, 0)}, 1, True),
    "packed": ({}, 1, True),
    "softmax_scale": ({"softmax_scale": 0.3}, 1, False),
    "query-key layer scaling, layer 3": ({"apply_query_key_layer_scaling": True}, 3, False),
    "learned sinks": ({"softmax_type": "learnable"}, 1, False),
    "learned sinks, window, packed": ({"softmax_type": "learnable", "window_size": (3, 0)}, 1, True),
    "off-by-one": ({"softmax_type": "off-by-one", "num_query_groups": HEADS}, 1, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_computes_what_unfused_attention_computes(model_parallel, case):
    fields, layer, packed = CASES[case]
    config = attention_config(**fields)
    unfused_cls = WindowedDotProductAttention if config.window_size else DotProductAttention
    unfused = unfused_cls(config, layer, AttnMaskType.causal, "self")
    sdpa = SDPAttention(config, layer, AttnMaskType.causal, "self")
    learned = fields.get("softmax_type") == "learnable"
    if learned:  # sinks that take a good part of each softmax row, the same in both
        with torch.no_grad():
            unfused.softmax_offset.copy_(torch.tensor([2.0, -1.0, 0.5, 1.5]))
            sdpa.softmax_offset.copy_(unfused.softmax_offset)
    q, k, v = qkv() if fields.get("num_query_groups") != HEADS else (qkv()[0], qkv()[0] * 0.5, qkv()[0] * 2)
    mask = block_causal_mask(PACKED_POSITIONS) if packed else None
    expected, got = run(unfused, q, k, v, mask), run(sdpa, q, k, v, mask)
    for name, a, b in zip(("output", "dq", "dk", "dv"), expected, got):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, atol=TOLERANCE, rtol=TOLERANCE), (name, (a - b).abs().max().item())
    if learned:
        a, b = unfused.softmax_offset.grad.cpu(), sdpa.softmax_offset.grad.cpu()
        assert a.abs().min() > 1e-3 and torch.allclose(a, b, atol=TOLERANCE, rtol=TOLERANCE), (a, b)


def test_window_semantics_are_megatron_cores(model_parallel):
    """(left, right): query i sees keys i-left..i+right, bottom-right aligned; -1 unbounded."""
    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    for sq, sk, window in [(8, 8, (3, 0)), (8, 8, (0, 0)), (8, 8, (2, 2)), (4, 8, (3, 0)), (8, 8, (7, 0))]:
        expected = get_sliding_window_causal_mask(sq, sk, window).cpu()
        assert torch.equal(blocked_outside_window(sq, sk, *window, torch.device("cpu")), expected), (sq, sk, window)
    sees = ~blocked_outside_window(4, 4, 1, 0, torch.device("cpu"))
    assert sees.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert torch.equal(~blocked_outside_window(4, 4, -1, 0, torch.device("cpu")), torch.ones(4, 4).tril().bool())


def test_packed_sequences_in_thd_format_are_kept_apart(model_parallel):
    """Sample boundaries as megatron-core's PackedSeqParams ('thd') give what the block mask gives."""
    config = attention_config(window_size=(4, 0))
    sdpa = SDPAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = (x[:, :1] for x in qkv())
    expected = run(sdpa, q, k, v, block_causal_mask(PACKED_POSITIONS[:1]))
    cu = torch.tensor([0, 10, 19, 24], dtype=torch.int32, device=DEVICE)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=10, max_seqlen_kv=10)
    got = run(sdpa, *(x.squeeze(1) for x in (q, k, v)), None, packed_seq_params=params)
    assert got[0].shape == (SEQ, HEADS * DIM)
    assert torch.allclose(got[0], expected[0].squeeze(1), atol=TOLERANCE)
    assert torch.allclose(got[1], expected[1].squeeze(1), atol=TOLERANCE)


def test_grouped_heads_reach_the_kernel_without_a_copy_and_causal_without_a_mask(model_parallel, monkeypatch):
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[1], k.shape[1], kw.get("attn_mask") is None, kw.get("is_causal"), kw.get("enable_gqa")))
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    SDPAttention(attention_config(), 1, AttnMaskType.causal, "self")(*qkv(), None)
    assert seen == [(HEADS, GROUPS, True, True, True)]


def test_key_value_heads_are_repeated_where_the_kernel_cannot_take_them_grouped(model_parallel, monkeypatch):
    """Torch < 2.5 (and a GPU kernel with a mask) gets the key/value heads repeated: same result."""
    from megatron_bridge.models import sdpa_attention

    config = attention_config(window_size=(3, 0))
    q, k, v = qkv()
    mask = block_causal_mask(PACKED_POSITIONS)
    grouped = run(SDPAttention(config, 1, AttnMaskType.causal, "self"), q, k, v, mask)
    monkeypatch.setattr(sdpa_attention, "_ENABLE_GQA", False)
    repeated = run(SDPAttention(config, 1, AttnMaskType.causal, "self"), q, k, v, mask)
    for a, b in zip(grouped, repeated):
        assert torch.allclose(a, b, atol=TOLERANCE)


def test_attention_dropout_applies_in_training_only(model_parallel):
    q, k, v = qkv()
    plain = SDPAttention(attention_config(), 1, AttnMaskType.causal, "self")(q, k, v, None)
    sdpa = SDPAttention(attention_config(attention_dropout=0.5), 1, AttnMaskType.causal, "self")
    assert torch.equal(sdpa.eval()(q, k, v, None), plain)
    dropped = sdpa.train()(q, k, v, None)
    assert not torch.allclose(dropped, plain, atol=1e-3)
    assert abs(dropped.mean().item() - plain.mean().item()) < 0.1  # inverted dropout keeps the scale


# ---------------------------------------------------------------------- the model and the choice
def core_attentions(model):
    return [type(layer.self_attention.core_attention) for layer in model.decoder.layers]


def test_the_layer_spec_puts_the_chosen_core_attention_in_every_layer(model_parallel, caplog):
    moe = dict(num_moe_experts=4, moe_layer_freq=[1, 0], moe_ffn_hidden_size=32, moe_token_dispatcher_type="allgather",
               moe_router_load_balancing_type="none")  # fmt: skip
    built = {}
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        for name, fields in {
            "auto, MoE": dict(moe),
            "unfused": dict(attention_backend=AttnBackend.unfused),
            "local, window": dict(attention_backend=AttnBackend.local, window_size=(4, 0)),
            "learned sinks": dict(softmax_type="learnable"),
        }.items():
            provider = tiny_model(vocab_size=128, **cpu_backend.CPU_MODEL_SETTINGS, **fields)
            provider.finalize()
            built[name] = core_attentions(provider.provide(pre_process=True, post_process=True))
    assert built == {
        "auto, MoE": [SDPAttention, SDPAttention],
        "unfused": [DotProductAttention, DotProductAttention],
        "local, window": [WindowedDotProductAttention, WindowedDotProductAttention],
        "learned sinks": [SDPAttention, SDPAttention],
    }
    unfused = "core attention: unfused (local layers (transformer_impl='local'); model.attention_backend=unfused keeps"
    assert caplog.text.count(unfused) == 1


def test_core_attention_choice(monkeypatch):
    from megatron_bridge import extras
    from megatron_bridge.models import MistralModelProvider7B

    def choice(**kw):
        return core_attention_choice(tiny_model(**kw))

    assert choice().kind == "sdpa" and "PyTorch SDPA serves this config" in choice().reason
    for backend in (AttnBackend.unfused, AttnBackend.local):
        assert choice(attention_backend=backend).kind == "unfused"
    assert choice(attention_backend=AttnBackend.flash).kind == "sdpa"
    found = choice(context_parallel_size=2)
    assert found.kind == "unfused" and "context parallelism (context_parallel_size=2)" in found.reason
    assert choice(softmax_type="off-by-one").kind == choice(softmax_type="learnable").kind == "sdpa"
    found = choice(log_max_attention_logit=True)
    assert found.kind == "unfused" and "qk_clip / log_max_attention_logit" in found.reason
    assert choice(transformer_layer_spec="x.y").kind == "unfused"
    mistral = core_attention_choice(MistralModelProvider7B())  # transformer_impl defaults to TE
    if not extras.is_installed("transformer_engine"):
        assert mistral.kind == "sdpa" and mistral.reason.startswith("TransformerEngine not installed")
        explicit = core_attention_choice(MistralModelProvider7B(transformer_impl="transformer_engine"))
        assert explicit.kind == "te" and "not installed here" in explicit.reason
    monkeypatch.setattr(extras, "is_installed", lambda module: module == "transformer_engine")
    assert core_attention_choice(MistralModelProvider7B()).kind == "te"


@pytest.mark.parametrize(
    "fields, expected",
    [
        (dict(window_size=(4, 2)), "model.window_size: (4, 2): a GPT layer is causal, so a window cannot reach after the query"),
        (dict(window_size=(4, 0), window_attn_skip_freq=[1, 0, 1]), "model.window_attn_skip_freq: lists 3 layers, the model has num_layers=2"),
        (dict(attention_backend=AttnBackend.flash, log_max_attention_logit=True),
         "model.attention_backend: 'flash' asks for a fused attention kernel; local layers have SDPA's, which cannot serve qk_clip"),
    ],
)  # fmt: skip
def test_attention_settings_no_core_attention_serves_are_refused(fields, expected):
    from megatron_bridge.training.config import runtime_config_update

    cfg = tiny_config(model=tiny_model(**fields))
    with pytest.raises(ConfigValidationError) as info:
        runtime_config_update(cfg)
    assert expected in str(info.value)


def test_selective_recompute_of_core_attention_is_dropped_for_sdpa_unless_the_user_set_it(caplog):
    preset = tiny_model()
    preset.apply_default("recompute_granularity", "selective")  # as a preset would
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        preset.finalize()
    assert preset.recompute_granularity is None
    assert "model.recompute_granularity=None: selective recompute covered only core_attn" in caplog.text
    both = tiny_model()
    both.apply_default("recompute_granularity", "selective")
    both.apply_default("recompute_modules", ["core_attn", "layernorm"])
    both.finalize()
    assert (both.recompute_granularity, both.recompute_modules) == ("selective", ["layernorm"])
    unfused = tiny_model(attention_backend=AttnBackend.unfused)
    unfused.apply_default("recompute_granularity", "selective")
    unfused.finalize()
    assert (unfused.recompute_granularity, unfused.recompute_modules) == ("selective", ["core_attn"])
    user = tiny_model(recompute_granularity="selective")
    user.finalize()
    assert (user.recompute_granularity, user.recompute_modules) == ("selective", ["core_attn"])
    assert "saves little memory" in core_attention_recompute(user)[1]
    listed = tiny_model(recompute_granularity="selective", recompute_modules=["core_attn"])
    listed.finalize()
    assert core_attention_recompute(listed) == ({}, None)


# ---------------------------------------------------------------------- MoE without a grouped GEMM
def test_grouped_gemm_decision_for_a_gpu_run():
    from megatron_bridge.models import MixtralModelProvider8x7B
    from megatron_bridge.models.experts import decide_grouped_gemm

    default = MixtralModelProvider8x7B()  # moe_grouped_gemm=True from the model class
    explicit = MixtralModelProvider8x7B(moe_grouped_gemm=True)
    legacy = MixtralModelProvider8x7B(moe_use_legacy_grouped_gemm=True)
    assert decide_grouped_gemm(default, te_layers=True, grouped_gemm_installed=False).grouped_gemm is True
    assert decide_grouped_gemm(default, te_layers=False, grouped_gemm_installed=True).grouped_gemm is True
    assert decide_grouped_gemm(explicit, te_layers=True, grouped_gemm_installed=False).message is None
    falls_back = decide_grouped_gemm(default, te_layers=False, grouped_gemm_installed=False)
    assert (falls_back.grouped_gemm, falls_back.refused) == (False, False)
    assert "the grouped_gemm package is not installed and the layers are not TransformerEngine's" in falls_back.message
    refused = decide_grouped_gemm(explicit, te_layers=False, grouped_gemm_installed=False)
    assert refused.refused and refused.message.startswith("moe_grouped_gemm=True needs a grouped GEMM")
    # TE's grouped linear layers do not serve the legacy GroupedMLP
    assert decide_grouped_gemm(legacy, te_layers=True, grouped_gemm_installed=False).grouped_gemm is False
    dense = tiny_model()
    assert decide_grouped_gemm(dense, te_layers=False, grouped_gemm_installed=False).message is None


def moe_config(**model):
    from megatron_bridge.models import MixtralModelProvider

    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  moe_ffn_hidden_size=32, num_moe_experts=4, seq_length=32, vocab_size=256)  # fmt: skip
    fields.update(model)
    return tiny_config(model=MixtralModelProvider(**fields))


def test_a_gpu_run_without_grouped_gemm_takes_sequential_experts_or_refuses(monkeypatch, caplog):
    from megatron_bridge.cli.dry_run import machine_problems
    from megatron_bridge.models import experts
    from megatron_bridge.training.config import runtime_config_update

    monkeypatch.setattr(experts, "grouped_gemm_installed", lambda: False)  # and TE is not installed here
    cfg = moe_config()
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        runtime_config_update(cfg, device="cuda")
    assert cfg.model.moe_grouped_gemm is False and not cfg.model.is_explicit("moe_grouped_gemm")
    assert "model.moe_grouped_gemm=False: the grouped_gemm package is not installed" in caplog.text

    cfg = moe_config(moe_grouped_gemm=True)
    assert any("model.moe_grouped_gemm: moe_grouped_gemm=True needs a grouped GEMM" in line for line in machine_problems(cfg))
    with pytest.raises(ConfigValidationError) as info:
        runtime_config_update(cfg, device="cuda")
    text = str(info.value)
    assert "model.moe_grouped_gemm: moe_grouped_gemm=True needs a grouped GEMM, but the grouped_gemm package is not installed" in text
    assert "pip install git+https://github.com/fanshiqing/grouped_gemm" in text and "model.moe_grouped_gemm=False" in text

    monkeypatch.setattr(experts, "grouped_gemm_installed", lambda: True)
    cfg = moe_config(moe_grouped_gemm=True)
    runtime_config_update(cfg, device="cuda")
    assert cfg.model.moe_grouped_gemm is True and not machine_problems(cfg)


def test_weight_conversion_on_a_gpu_without_grouped_gemm_uses_sequential_experts(model_parallel, monkeypatch):
    from megatron_bridge.models import experts
    from megatron_bridge.models.hf.runtime import prepare

    monkeypatch.setattr(experts, "grouped_gemm_installed", lambda: False)
    assert prepare(moe_config().model, "cuda").moe_grouped_gemm is False
    with pytest.raises(ConfigValidationError, match="model.moe_grouped_gemm: moe_grouped_gemm=True needs a grouped GEMM"):
        prepare(moe_config(moe_grouped_gemm=True).model, "cuda")


def test_context_parallelism_on_local_layers_is_refused_before_anything_is_built(monkeypatch):
    from megatron_bridge import extras
    from megatron_bridge.cli.dry_run import machine_problems
    from megatron_bridge.models.attention import layer_problems
    from megatron_bridge.training.setup import refuse_what_the_layers_cannot_run

    cfg = tiny_config(model=tiny_model(context_parallel_size=2))
    expected = "model.context_parallel_size: 2 needs TransformerEngine layers; local layers (transformer_impl='local') do not split"
    with pytest.raises(ConfigValidationError, match=r"set model\.context_parallel_size=1") as info:
        refuse_what_the_layers_cannot_run(cfg)
    assert expected in str(info.value)
    assert any(line.startswith(expected) for line in machine_problems(cfg))  # the dry run's "would fail" lines
    te_asked = tiny_model(context_parallel_size=2, transformer_impl="transformer_engine")
    monkeypatch.setattr(extras, "is_installed", lambda module: False)
    assert "(TransformerEngine is not installed)" in layer_problems(te_asked)[0].message
    monkeypatch.setattr(extras, "is_installed", lambda module: module == "transformer_engine")
    assert layer_problems(te_asked) == [] and layer_problems(tiny_model()) == []
