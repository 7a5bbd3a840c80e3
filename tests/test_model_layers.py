"""Layer modules megatron-core lacks (models.layers): norms after attention and MLP, qk-norm over
the whole projections, the provider fields that build them and the family hook on the layer spec.
OLMo 2's logits against transformers (test_hf_weights, test_hf_parallel) check them end to end;
test_hf_parallel also runs the qk-norm over two tensor-parallel ranks against one process
(forward and gradients, scripts/projection_norm_tp.py)."""

from __future__ import annotations

import pytest
import torch
from factories import one_process_group, sequence_parallel_layer_spec, tiny_model

from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.models import GPTModelProvider, count_parameters
from megatron_bridge.models.layers.output_norm import NormedBiasDropoutAdd
from megatron_bridge.models.layers.spec_edits import edit_layers, layer_numbers

OLMO_LIKE = dict(
    normalization="RMSNorm", input_layernorms=False, output_layernorms=True, qk_layernorm=True,
    qk_layernorm_per_head=False, num_query_groups=2, ffn_hidden_size=96, vocab_size=256, use_cpu_initialization=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_parallel():
    from megatron.core import parallel_state

    from megatron_bridge.training import cpu_backend

    with one_process_group(), cpu_backend.active("cpu"):  # a gloo group: the model is on CPU on every machine
        parallel_state.initialize_model_parallel()
        yield
        parallel_state.destroy_model_parallel()


def test_normed_bias_dropout_add_normalizes_output_plus_bias_before_the_residual():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = tiny_model(normalization="RMSNorm", layernorm_epsilon=1e-6)
    module = NormedBiasDropoutAdd(config, WrappedTorchNorm)  # built as megatron-core builds its norms
    with torch.no_grad():
        module.norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x, bias, residual = torch.randn(3, 2, 64), torch.randn(64), torch.randn(3, 2, 64)
    out = module(False, False)((x, bias), residual, 0.0)
    y = x + bias
    expected = residual + module.norm.weight * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(out, expected, atol=1e-6)
    assert module(True, False)((x, None), residual, 0.0).shape == residual.shape


def test_layer_fields_build_the_modules_and_the_hook_edits_each_layer(model_parallel):
    seen = []

    class Hooked(GPTModelProvider):
        def adjust_layer_spec(self, spec, vp_stage=None):
            def edit(layer, number):
                seen.append(number)
                return layer

            return edit_layers(spec, edit, layer_numbers(self, vp_stage, len(spec.layer_specs)))

    sizes = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, position_embedding_type="rope")
    provider = Hooked(**sizes, transformer_impl="local", **OLMO_LIKE)
    provider.finalize()
    model = provider.provide(pre_process=True, post_process=True)
    names = {n: p.numel() for n, p in model.named_parameters()}
    assert seen == [1, 2]
    layer = "decoder.layers.0."
    assert layer + "input_layernorm.weight" not in names and layer + "pre_mlp_layernorm.weight" not in names
    assert names[layer + "self_attn_bda.norm.weight"] == names[layer + "mlp_bda.norm.weight"] == 64
    assert names[layer + "self_attention.q_layernorm.weight"] == 4 * 16  # every query head
    assert names[layer + "self_attention.k_layernorm.weight"] == 2 * 16  # every key head
    assert count_parameters(provider).total == sum(names.values())


def test_layer_fields_that_cannot_be_built_are_refused_together():
    p = tiny_model(
        input_layernorms=False, transformer_impl="transformer_engine", qk_layernorm_per_head=False,
        num_attention_heads=4, num_query_groups=1, tensor_model_parallel_size=2,
    )  # fmt: skip
    with pytest.raises(ConfigValidationError) as err:
        p.finalize()
    text = str(err.value)
    assert "input_layernorms: False needs megatron-core's local layers" in text and "transformer_impl='local'" in text
    assert "qk_layernorm_per_head: False says how queries and keys are normalized, but qk_layernorm is False" in text
    assert (
        "qk_layernorm_per_head: False is an RMSNorm over the whole projections, but normalization='LayerNorm'" in text
    )
    assert "1 query groups do not split over tensor_model_parallel_size=2" in text
    custom = tiny_model(output_layernorms=True, transformer_layer_spec=sequence_parallel_layer_spec)
    with pytest.raises(ConfigValidationError, match="a custom layer spec is built as given, without input_layernorms"):
        custom.finalize()
