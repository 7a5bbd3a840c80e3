"""Model families as plain data: published sizes, architecture facts, and the analytic parameter
count checked against megatron-core models actually built."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest
import torch

from factories import one_process_group

from megatron_bridge import models as M
from megatron_bridge.models import count_parameters
from megatron_bridge.training.config import ConfigValidationError

# provider class -> (published total parameters, published active parameters per token)
PUBLISHED = {
    M.Llama2ModelProvider7B: (6.74e9, None),
    M.Llama3ModelProvider8B: (8.03e9, None),
    M.Llama3ModelProvider70B: (70.6e9, None),
    M.Llama31ModelProvider405B: (405.9e9, None),
    M.MistralModelProvider7B: (7.24e9, None),
    M.MixtralModelProvider8x7B: (46.7e9, 12.9e9),
    M.Qwen25ModelProvider7B: (7.62e9, None),
    M.Qwen3ModelProvider8B: (8.19e9, None),
    M.Qwen3MoEModelProvider30B_A3B: (30.5e9, 3.3e9),
    M.Olmo2ModelProvider7B: (7.30e9, None),
    M.Phi3ModelProviderMini: (3.82e9, None),
    # Gemma 3 text decoders: the technical report's embedding + non-embedding parameters
    M.Gemma3ModelProvider1B: (1.000e9, None),
    M.Gemma3ModelProvider4B: (3.884e9, None),
    M.Gemma3ModelProvider27B: (27.016e9, None),
}


def _within(count: int, published: float, tolerance: float = 0.02) -> bool:
    return abs(count - published) <= tolerance * published


@pytest.mark.parametrize("cls", list(PUBLISHED), ids=lambda c: c.__name__)
def test_parameter_count_matches_published_size(cls):
    total, active = PUBLISHED[cls]
    count = count_parameters(cls())
    assert _within(count.total, total), f"{cls.__name__}: {count.total / 1e9:.3f}B vs published {total / 1e9}B"
    expected_active = active if active is not None else total
    assert _within(count.active, expected_active), f"{cls.__name__}: active {count.active / 1e9:.3f}B"


@pytest.mark.parametrize("tp", [1, 8])
def test_padded_vocabulary_keeps_counts_within_two_percent(tp):
    for cls, (total, _) in PUBLISHED.items():
        assert _within(count_parameters(cls(tensor_model_parallel_size=tp)).total, total), cls.__name__


def test_tiny_gpt_has_a_few_hundred_thousand_parameters():
    count = count_parameters(M.TinyGPTModelProvider())
    assert count.total == 360_288
    assert 200_000 < count.total < 1_000_000


@pytest.mark.parametrize(
    "cls, vocab",
    [
        (M.Llama2ModelProvider7B, 32000),
        (M.Llama3ModelProvider8B, 128256),
        (M.Llama3ModelProvider70B, 128256),
        (M.Llama31ModelProvider405B, 128256),
        (M.MistralModelProvider7B, 32000),
        (M.MixtralModelProvider8x7B, 32000),
        (M.Qwen25ModelProvider7B, 152064),
        (M.Qwen3ModelProvider8B, 151936),
        (M.Qwen3MoEModelProvider30B_A3B, 151936),
        (M.Olmo2ModelProvider7B, 100352),
        (M.Phi3ModelProviderMini, 32064),
        (M.Gemma3ModelProvider1B, 262144),
        (M.Gemma3ModelProvider4B, 262208),
        (M.Gemma3ModelProvider27B, 262208),
        (M.TinyGPTModelProvider, 256),
    ],
)
def test_vocabulary_sizes(cls, vocab):
    assert cls().vocab_size == vocab


def test_llama_family_architecture():
    for cls in (M.Llama2ModelProvider7B, M.Llama3ModelProvider8B, M.MistralModelProvider7B, M.Qwen3ModelProvider8B):
        p = cls()
        assert p.normalization == "RMSNorm" and p.gated_linear_unit and p.activation_func is torch.nn.functional.silu
        assert not p.add_bias_linear and p.position_embedding_type == "rope"
        assert not p.share_embeddings_and_output_weights
        assert p.hidden_dropout == 0.0 and p.attention_dropout == 0.0
    assert M.Llama2ModelProvider7B().rotary_base == 10000 and M.Llama2ModelProvider7B().seq_length == 4096
    assert M.Llama3ModelProvider8B().rotary_base == 500000 and M.Llama3ModelProvider8B().num_query_groups == 8
    assert not M.Llama3ModelProvider70B().rope_scaling
    llama31 = M.Llama31ModelProvider405B()
    assert llama31.rope_scaling and llama31.rope_scaling_factor == 8.0 and llama31.seq_length == 131072
    assert M.MistralModelProvider7B().window_size == (4095, 0)  # 4096 tokens seen, as published
    from megatron_bridge.models.mistral import MistralFamily

    assert MistralFamily().hf_config(M.MistralModelProvider7B(), "bfloat16")["sliding_window"] == 4096


def test_qwen_family_architecture():
    qwen25 = M.Qwen25ModelProvider7B()
    assert qwen25.add_qkv_bias and not qwen25.qk_layernorm and qwen25.layernorm_epsilon == 1e-6
    qwen3 = M.Qwen3ModelProvider8B()
    assert qwen3.qk_layernorm and not qwen3.add_qkv_bias and qwen3.kv_channels == 128
    assert qwen3.rotary_base == 1000000


def test_mixture_of_experts_settings():
    mixtral = M.MixtralModelProvider8x7B()
    assert (mixtral.num_moe_experts, mixtral.moe_router_topk, mixtral.moe_ffn_hidden_size) == (8, 2, 14336)
    assert mixtral.window_size is None and mixtral.rotary_base == 1000000
    qwen = M.Qwen3MoEModelProvider30B_A3B()
    assert (qwen.num_moe_experts, qwen.moe_router_topk, qwen.moe_ffn_hidden_size) == (128, 8, 768)
    for p in (mixtral, qwen):
        assert p.moe_router_load_balancing_type == "aux_loss" and p.moe_aux_loss_coeff > 0
        assert p.moe_grouped_gemm and p.moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize("cls", [*PUBLISHED, M.TinyGPTModelProvider], ids=lambda c: c.__name__)
def test_class_defaults_are_not_user_choices_and_finalize(cls):
    p = cls()
    assert p.explicit_fields() == frozenset()  # presets may still set precision fields
    p.finalize()  # megatron-core's checks accept the published architecture
    assert p.ffn_hidden_size is not None and p.kv_channels is not None


def test_user_values_override_family_defaults():
    p = M.Llama3ModelProvider8B(num_layers=4, seq_length=1024)
    assert p.num_layers == 4 and p.seq_length == 1024 and p.hidden_size == 4096
    assert p.is_explicit("num_layers") and not p.is_explicit("hidden_size")
    with pytest.raises(TypeError, match="num_layers"):
        M.Llama3ModelProvider8B(num_layers="4")


# ---------------------------------------------------------------------- built models
@pytest.fixture(scope="module")
def model_parallel():
    """A one-process gloo group with megatron-core model-parallel state (torn down afterwards)."""
    from megatron.core import parallel_state

    with one_process_group():
        parallel_state.initialize_model_parallel()
        yield
        parallel_state.destroy_model_parallel()


SMALL = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=300,
    seq_length=32,
    transformer_impl="local",
    use_cpu_initialization=True,
)
MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=24, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather")


@pytest.mark.parametrize(
    "make",
    [
        lambda: M.TinyGPTModelProvider(),
        lambda: M.GPTModelProvider(**SMALL),  # learned positions, LayerNorm, biases, tied output
        lambda: M.Llama3ModelProvider(**SMALL),
        lambda: M.MistralModelProvider7B(**SMALL),
        lambda: M.Qwen2ModelProvider(**SMALL),
        lambda: M.Qwen3ModelProvider(**{**SMALL, "kv_channels": 32}),
        lambda: M.MixtralModelProvider(**SMALL, **MOE),
        lambda: M.Qwen3MoEModelProvider(**{**SMALL, "kv_channels": 32}, **MOE, moe_router_topk=2),  # 8 of 4 experts is refused
        lambda: M.Olmo2ModelProvider(**SMALL),
        lambda: M.Phi3ModelProvider(**SMALL, rotary_percent=0.5),
        # attention sinks, biases on attention, router and experts
        lambda: M.GptOssModelProvider(**{**SMALL, "kv_channels": 32}, **MOE, moe_router_topk=2),
        lambda: M.Gemma3ModelProvider(**SMALL, kv_channels=32, window_size=(7, 0), window_attn_skip_freq=2),
        lambda: M.Gemma2ModelProvider(**SMALL, kv_channels=32, window_size=(7, 0)),
    ],
    ids=["tiny", "gpt", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmo2", "phi3", "gpt_oss", "gemma3",
         "gemma2"],
)
def test_count_matches_built_model(model_parallel, make):
    from megatron_bridge.training import cpu_backend

    provider = make()
    provider.finalize()
    with cpu_backend.active():  # megatron-core allocates the attention sinks on the GPU (the CPU on a CPU machine)
        model = provider.provide(pre_process=True, post_process=True)
    built = sum(p.numel() for p in model.parameters())
    count = count_parameters(provider)
    assert count.total == built
    if provider.num_moe_experts:
        expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        per_token = expert // provider.num_moe_experts * provider.moe_router_topk
        assert count.active == built - expert + per_token


def test_provide_finalizes_a_provider_not_finalized_yet(model_parallel):
    provider = M.GPTModelProvider(**SMALL)
    provider.hidden_size = 32  # changed after construction: the derived values follow it
    model = provider.provide(pre_process=True, post_process=True)
    assert provider.is_finalized() and provider.ffn_hidden_size == 96 and provider.kv_channels == 8
    assert model.embedding.word_embeddings.weight.shape == (384, 32)  # 300 padded to a multiple of 128
    provider.hidden_size = 64  # a change after finalize: finalized again, for the new size
    assert not provider.is_finalized()
    provider.provide(pre_process=True, post_process=True)
    assert provider.is_finalized() and provider.kv_channels == 16
    with pytest.raises(ConfigValidationError) as err:  # finalize's error, not a crash inside megatron-core
        M.GPTModelProvider(**{**SMALL, "num_attention_heads": 5}).provide()
    assert err.value.errors[0].startswith("hidden_size: hidden_size 64 is not a multiple of num_attention_heads 5")


def test_family_modules_import_nothing_heavy():
    """The family modules (and every module of a family package) are plain data: importing them
    adds no import beyond what gpt_provider.py already needs (megatron-core's transformer config
    module, which brings torch) and light standard modules."""
    import pkgutil

    allowed = ("__future__", "typing", "dataclasses", "functools", "logging", "torch",
               "megatron.core.transformer.transformer_config", "megatron_bridge.config.base",
               "megatron_bridge.config.errors", "megatron_bridge.models.")  # fmt: skip
    modules = []
    for module in map(importlib.import_module, M.family_modules()):
        modules.append(module)
        for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
            modules.append(importlib.import_module(f"{module.__name__}.{info.name}"))
    assert "megatron_bridge.models.deepseek.providers" in {m.__name__ for m in modules}
    for module in modules:
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module] if node.level == 0 else [f"{module.__package__}."]
            else:
                continue
            for name in names:
                assert name.startswith(allowed), f"{module.__name__} imports {name}"


@pytest.mark.timeout(120)
def test_a_config_names_a_family_class_before_anything_imported_it():
    """`megatron_bridge.models` declares its families to the name registry (register_lazy_exports):
    in a fresh process, a family provider resolves by its public or its defining path, and a
    name that is no registered class is refused without importing the module it names."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from megatron_bridge.config import targets\n"
        "assert 'megatron_bridge.models' not in sys.modules\n"
        "print(targets.resolve('megatron_bridge.models.llama.Llama3ModelProvider8B').__name__)\n"
        "print(targets.resolve('megatron_bridge.models.Qwen3ModelProvider').__name__)\n"
        "print(targets.resolve('megatron_bridge.ConfigContainer').__name__)\n"
        "for name in ('megatron_bridge.__main__.main', 'megatron_bridge.models.llama.F'):\n"
        "    try:\n"
        "        targets.resolve(name)\n"
        "    except targets.TargetNotAllowedError:\n"
        "        print('refused', name)\n"
        "print('__main__ imported:', 'megatron_bridge.__main__' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:6] == [
        "Llama3ModelProvider8B",
        "Qwen3ModelProvider",
        "ConfigContainer",
        "refused megatron_bridge.__main__.main",
        "refused megatron_bridge.models.llama.F",
        "__main__ imported: False",
    ]
