"""The checks of `GPTModelProvider` fields against each other: what megatron-core accepts in its
config but builds wrongly, fails on mid-run, or ignores. Each `check_*(m, p)` reports the
problems of provider `m` into `p`; `GPTModelProvider._finalize` runs them in order."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from megatron_bridge.config.errors import Problems
from megatron_bridge.config.schema import specs
from megatron_bridge.models.layers.spec_edits import changes_layers


def check_layer_fields(m: Any, p: Problems) -> None:
    """The layer fields megatron-core lacks are built into megatron-core's own layer spec."""
    if changes_layers(m) and m.transformer_layer_spec is not None:
        p.add(
            "transformer_layer_spec",
            "a custom layer spec is built as given, without input_layernorms=False, output_layernorms or "
            "qk_layernorm_per_head=False",
            "build those into the custom spec and leave the fields at their defaults (or unset the spec)",
        )
    p.check(
        m.input_layernorms or m.transformer_impl == "local",
        "input_layernorms",
        f"False needs megatron-core's local layers (TransformerEngine fuses these norms into the linear "
        f"layers), but transformer_impl={m.transformer_impl!r}",
        "set model.transformer_impl='local'",
    )
    if m.qk_layernorm_per_head:
        return
    p.check(
        m.qk_layernorm,
        "qk_layernorm_per_head",
        "False says how queries and keys are normalized, but qk_layernorm is False",
        "set model.qk_layernorm=True (or leave qk_layernorm_per_head at True)",
    )
    p.check(
        m.normalization == "RMSNorm",
        "qk_layernorm_per_head",
        f"False is an RMSNorm over the whole projections, but normalization={m.normalization!r}",
        "set model.normalization='RMSNorm' (or leave qk_layernorm_per_head at True)",
    )
    groups, tp = m.num_query_groups or m.num_attention_heads, m.tensor_model_parallel_size
    p.check(
        groups % tp == 0,
        "qk_layernorm_per_head",
        f"False normalizes each rank's whole key heads, but {groups} query groups do not split over "
        f"tensor_model_parallel_size={tp}",
        "choose a TP size that divides num_query_groups",
    )


def check_layer_modules(m: Any, p: Problems) -> None:
    """The fields built from the project's layer modules (`models.layers`) where they apply."""
    local = m.transformer_impl == "local"
    if m.layernorm_zero_centered_gamma and local:
        p.check(
            m.normalization == "RMSNorm",
            "layernorm_zero_centered_gamma",
            f"local layers have it for RMSNorm only, but normalization={m.normalization!r}",
            "set model.normalization='RMSNorm', or use TransformerEngine layers",
        )
    if m.local_rotary_base is not None:
        for ok, message, fix in (
            (m.position_embedding_type == "rope", f"needs rotary embeddings, but position_embedding_type="
             f"{m.position_embedding_type!r}", "set model.position_embedding_type='rope'"),
            (m.window_size is not None, "applies to the sliding-window layers, but window_size is None",
             "set model.window_size, or leave model.local_rotary_base unset"),
            (not m.multi_latent_attention, "is not implemented for multi-latent attention",
             "leave model.local_rotary_base unset"),
            (m.context_parallel_size == 1, f"is not implemented with context parallelism "
             f"(context_parallel_size={m.context_parallel_size})", "set model.context_parallel_size=1"),
        ):  # fmt: skip
            p.check(ok, "local_rotary_base", message, fix)
    if m.attention_logit_softcap is not None:
        p.check(
            local,
            "attention_logit_softcap",
            f"needs megatron-core's unfused core attention of local layers, but transformer_impl="
            f"{m.transformer_impl!r}",
            "set model.transformer_impl='local'",
        )
        p.check(
            not m.apply_query_key_layer_scaling,
            "attention_logit_softcap",
            "caps the true scores, but apply_query_key_layer_scaling divides them by the layer number first",
            "set model.apply_query_key_layer_scaling=False",
        )
    custom = [
        name
        for name in ("local_rotary_base", "attention_logit_softcap")
        if getattr(m, name) is not None and m.transformer_layer_spec is not None
    ]
    for name in custom:
        p.add(
            name,
            "a custom transformer_layer_spec is built as given, without this setting",
            f"build it into the custom spec and leave model.{name} unset (or unset the spec)",
        )


def check_expert_biases(m: Any, p: Problems) -> None:
    """megatron-core adds an expert's output bias on every expert-tensor-parallel rank before
    their partial outputs are summed, so it splits no expert with biases (expert_tensor_parallel_size
    1); unset, that is derived. Its shared experts have no biases at all."""
    if not m.num_moe_experts or not m.add_bias_linear:
        return
    p.check(
        not m.moe_shared_expert_intermediate_size,
        "moe_shared_expert_intermediate_size",
        "megatron-core's shared experts have no biases, but add_bias_linear=True",
        "set model.add_bias_linear=False, or leave model.moe_shared_expert_intermediate_size unset",
    )
    etp = m.expert_tensor_parallel(m.tensor_model_parallel_size)
    if etp is not None and not m.is_explicit("expert_tensor_parallel_size"):
        m._derive("expert_tensor_parallel_size", etp)
    p.check(
        etp in (None, 1),
        "expert_tensor_parallel_size",
        f"{etp}: megatron-core splits no expert with biases (add_bias_linear=True) over tensor-parallel ranks",
        "set model.expert_tensor_parallel_size=1 (the experts are split over expert-parallel ranks instead)",
    )


def check_experts(m: Any, p: Problems) -> None:
    """MoE settings megatron-core accepts in its config but fails on at the model build or the
    first forward."""
    if not m.num_moe_experts:
        return
    p.check(
        m.moe_router_topk <= m.num_moe_experts,
        "moe_router_topk",
        f"{m.moe_router_topk} experts per token, but the model has num_moe_experts={m.num_moe_experts} "
        "(the router's top-k fails at the first forward pass)",
        f"set model.moe_router_topk to at most {m.num_moe_experts}",
    )
    freq = m.moe_layer_freq
    if isinstance(freq, list) and m.num_layers is not None:
        p.check(
            len(freq) == m.num_layers,
            "moe_layer_freq",
            f"lists {len(freq)} layers, the model has num_layers={m.num_layers} (megatron-core fails on it at the "
            "model build)",
            "give one 0/1 per layer (1: a mixture-of-experts layer), or an int N (every Nth layer)",
        )
    if m.moe_token_dispatcher_type == "flex":
        etp = m.expert_tensor_parallel(m.tensor_model_parallel_size) or m.tensor_model_parallel_size
        p.check(
            etp * m.expert_model_parallel_size > 1,
            "moe_token_dispatcher_type",
            f"'flex' dispatches over the expert tensor- and expert-parallel ranks together, and there is one "
            f"(expert_tensor_parallel_size={etp}, expert_model_parallel_size={m.expert_model_parallel_size})",
            "use 'alltoall' or 'allgather', or raise expert_model_parallel_size",
        )
    p.check(
        not m.moe_apply_probs_on_input or m.moe_router_topk == 1,
        "moe_apply_probs_on_input",
        f"megatron-core applies the routing probability to the expert input only with one expert per token, "
        f"but moe_router_topk={m.moe_router_topk}",
        "set model.moe_router_topk=1, or model.moe_apply_probs_on_input=False",
    )


def check_recompute(m: Any, p: Problems) -> None:
    """megatron-core's selective recompute of a dense MLP returns the MLP's output bias (a
    parameter) through its checkpoint function, which then becomes the bias's gradient
    function: the backward pass recurses without end."""
    if m.recompute_granularity != "selective" or "mlp" not in (m.recompute_modules or ()):
        return
    freq = m.moe_layer_freq
    dense = not m.num_moe_experts or (0 in freq if isinstance(freq, list) else freq > 1 and m.num_layers > 1)
    p.check(
        not (dense and m.add_bias_linear),
        "recompute_modules",
        "'mlp' recomputes the dense MLPs, and megatron-core's MLP recompute fails with their biases "
        "(add_bias_linear=True): the backward pass recurses without end",
        "set model.add_bias_linear=False, or leave 'mlp' out of model.recompute_modules",
    )


def check_rotary(m: Any, p: Problems) -> None:
    """YaRN reads only its own fields; megatron-core scales every rotary embedding's cos and
    sin by the yarn_* attention factor, so those fields stay at their defaults without it."""
    if m.position_embedding_type != "yarn":
        for name, default in _yarn_fields(type(m)):
            if getattr(m, name) != default:
                p.add(
                    name,
                    f"{getattr(m, name)!r} applies to YaRN only, but position_embedding_type="
                    f"{m.position_embedding_type!r} (megatron-core would still scale the rotary embedding by it)",
                    f"set model.position_embedding_type='yarn' or leave model.{name} at {default!r}",
                )
        return
    ignored = {
        "rotary_percent": (m.rotary_percent == 1.0, "1.0"),
        "rotary_interleaved": (not m.rotary_interleaved, "False"),
        "seq_len_interpolation_factor": (m.seq_len_interpolation_factor is None, "None"),
        "rope_scaling": (not m.rope_scaling, "False"),
    }
    for name, (fine, value) in ignored.items():
        p.check(
            fine,
            name,
            f"{getattr(m, name)!r} is not applied with position_embedding_type='yarn' (megatron-core's "
            "YaRN embedding rotates whole heads, not interleaved, with its own scaling)",
            f"set model.{name}={value}",
        )
    p.check(
        m.yarn_rotary_scaling_factor >= 1.0,
        "yarn_rotary_scaling_factor",
        f"{m.yarn_rotary_scaling_factor} is below 1: YaRN extends the context",
        "use a factor of at least 1",
    )
    p.check(
        not m.apply_rope_fusion or m.yarn_rotary_scaling_factor == 1.0,
        "apply_rope_fusion",
        "TransformerEngine's fused rotary embedding cannot apply YaRN's attention scaling",
        "set model.apply_rope_fusion=False",
    )


def check_enabled_by(m: Any, p: Problems) -> None:
    """Fields megatron-core reads only when another setting turns their feature on: changed
    from the default without it, they would do nothing."""
    for name, enabled, feature, setting in _ENABLED_BY:
        value = getattr(m, name)
        default = None if name in _NONE_WHEN_OFF else specs(type(m))[name].default
        if value != default and not enabled(m):
            p.add(
                name,
                f"{value!r} has no effect without {feature} ({setting}: megatron-core reads it only then)",
                f"set {setting}, or leave model.{name} at {default!r}",
            )


def check_activation(m: Any, p: Problems) -> None:
    """megatron-core's fused gated activations (bias_activation_fusion) clamp the first
    projection's output before adding its bias, and the fused SwiGLU does not clamp at all;
    unfused, the bias is added, then the clamp applied."""
    if m.activation_func_clamp_value is None or not m.bias_activation_fusion:
        return
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    why = None
    if m.activation_func is not quick_gelu:
        why = "megatron-core's fused kernel clamps only with its quick_gelu"
    elif m.add_bias_linear:
        why = "megatron-core's fused kernel clamps before adding the bias"
    p.check(
        why is None,
        "bias_activation_fusion",
        f"True with activation_func_clamp_value={m.activation_func_clamp_value}: {why}",
        "set model.bias_activation_fusion=False",
    )


_ENABLED_BY: tuple[tuple[str, Callable[[Any], bool], str, str], ...] = (
    ("rope_scaling_factor", lambda m: m.rope_scaling, "Llama 3.1's rope scaling", "model.rope_scaling=True"),
    ("mrope_section", lambda m: m.position_embedding_type == "mrope", "multimodal rope",
     "model.position_embedding_type='mrope'"),
    ("moe_ffn_hidden_size", lambda m: bool(m.num_moe_experts), "experts", "model.num_moe_experts"),
    ("moe_shared_expert_intermediate_size", lambda m: bool(m.num_moe_experts), "experts", "model.num_moe_experts"),
    ("moe_shared_expert_gate", lambda m: bool(m.moe_shared_expert_intermediate_size), "shared experts",
     "model.moe_shared_expert_intermediate_size"),
    ("moe_shared_expert_overlap", lambda m: bool(m.moe_shared_expert_intermediate_size), "shared experts",
     "model.moe_shared_expert_intermediate_size"),
    ("moe_token_drop_policy", lambda m: m.moe_expert_capacity_factor is not None, "an expert capacity",
     "model.moe_expert_capacity_factor"),
    ("moe_router_bias_update_rate", lambda m: m.moe_router_enable_expert_bias, "the routers' expert bias",
     "model.moe_router_enable_expert_bias=True"),
    ("mtp_loss_scaling_factor", lambda m: bool(m.mtp_num_layers), "multi-token prediction", "model.mtp_num_layers"),
    ("cross_entropy_fusion_impl", lambda m: m.cross_entropy_loss_fusion, "the fused cross entropy",
     "model.cross_entropy_loss_fusion=True"),
    *((name, lambda m: m.cpu_offloading, "layer offloading", "model.cpu_offloading=True") for name in (
        "cpu_offloading_num_layers", "cpu_offloading_activations", "cpu_offloading_weights",
        "cpu_offloading_double_buffering")),
)  # fmt: skip
"""(field, whether its feature is on, the feature, the setting that turns it on): `check_enabled_by`."""

_NONE_WHEN_OFF = frozenset({"moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"})
"""Fields of `_ENABLED_BY` megatron-core wants None while their feature is off (a provider's
default may be set: DeepSeek's expert widths)."""


@functools.cache
def _yarn_fields(cls: type) -> tuple[tuple[str, object], ...]:
    """(name, default) of the YaRN fields, which apply only with position_embedding_type='yarn', as
    the provider base declares them (a family's own defaults count as changes without YaRN)."""
    owner = next(k for k in reversed(cls.__mro__) if "yarn_rotary_scaling_factor" in vars(k).get("__annotations__", {}))
    return tuple((f.name, f.default) for f in dataclasses.fields(owner) if f.name.startswith("yarn_"))
