"""`GPTModelProvider`: a GPT architecture as a config, and the builder of its megatron-core model."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
from typing import Any, Callable, Iterator, Literal, Optional, Union

from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import FACTOR, SIZE, field
from megatron_bridge.config.targets import TargetNotAllowedError, resolve
from megatron_bridge import extras
from megatron_bridge.models.attention import (
    check_attention,
    core_attention_choice,
    core_attention_module,
    core_attention_recompute,
    replace_core_attention,
    te_layers,
)
from megatron_bridge.models.layers.expert_bias import with_biased_experts
from megatron_bridge.models.layers.spec_edits import apply_layer_fields, changes_layers
from megatron_bridge.models.layers.embedding_scale import scale_word_embeddings
from megatron_bridge.models.layers.softcap import cap_output_logits

logger = logging.getLogger(__name__)


@config_dataclass
class GPTModelProvider(TransformerConfig, ConfigBase):
    """megatron-core `TransformerConfig` plus the GPT-level fields, with deferred post-init.

    Construction stores values only; `finalize()` runs megatron-core's checks and derived values
    (ffn_hidden_size, kv_channels, init methods, ...). `provide()` builds the `GPTModel` for one
    pipeline stage.
    """

    attention_backend: AttnBackend = AttnBackend.auto
    """Core attention. auto: TransformerEngine's choice in TE layers; in local layers PyTorch SDPA
    where it serves the config, else megatron-core's unfused DotProductAttention (logged).
    unfused/local: DotProductAttention in local layers. flash/fused: those TE kernels in TE layers,
    SDPA in local layers (refused where SDPA cannot serve the config)."""

    fp16_lm_cross_entropy: bool = False
    """Compute the cross entropy of the output layer in fp16."""

    parallel_output: bool = True
    """Keep the logits split over tensor-parallel ranks (the loss handles the split)."""

    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the input embedding."""

    make_vocab_size_divisible_by: int = field(128, range=SIZE)
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""

    position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = "learned_absolute"
    """Position encoding: learned positions, rotary embeddings (rope), rotary embeddings with YaRN
    context extension (yarn: the yarn_* fields), or none."""

    rotary_base: int = field(10000, range="[1, 1000000000000]")
    """RoPE base period."""

    rotary_percent: float = field(1.0, range="(0, 1]")
    """Fraction of each head's dimensions that RoPE rotates."""

    seq_len_interpolation_factor: Optional[float] = field(None, range=FACTOR)
    """Scale RoPE positions by 1/factor (linear position interpolation)."""

    rope_scaling: bool = False
    """Apply Llama 3.1-style RoPE frequency scaling."""

    rope_scaling_factor: float = field(8.0, range=FACTOR)
    """Scaling factor of Llama 3.1-style RoPE scaling."""

    yarn_rotary_scaling_factor: float = field(1.0, range="[1, 1000]")
    """YaRN: how many times the context is extended beyond yarn_original_max_position_embeddings
    (position_embedding_type='yarn')."""

    yarn_original_max_position_embeddings: int = field(4096, range=SIZE)
    """YaRN: the context length the rotary frequencies were pretrained for."""

    yarn_beta_fast: float = field(32.0, range=FACTOR)
    """YaRN: dimensions rotating more often than this over the original context keep their
    frequency."""

    yarn_beta_slow: float = field(1.0, range=FACTOR)
    """YaRN: dimensions rotating less often than this are interpolated by the scaling factor (a
    linear ramp between the two)."""

    yarn_mscale: Optional[float] = field(None, range="[0, 100]")
    """YaRN attention scaling: with yarn_mscale_all_dim also set, cos and sin are scaled by
    (0.1 * yarn_mscale * ln(factor) + 1) / (0.1 * yarn_mscale_all_dim * ln(factor) + 1); unset, by
    0.1 * ln(factor) + 1."""

    yarn_mscale_all_dim: Optional[float] = field(None, range="[0, 100]")
    """YaRN attention scaling: the denominator's coefficient (see yarn_mscale)."""

    yarn_correction_range_round_to_int: bool = True
    """YaRN: round the ramp's dimension bounds outward to whole dimensions (transformers'
    `truncate`)."""

    input_layernorms: bool = True
    """Normalize the input of attention and of the MLP (pre-norm). False: only their outputs are
    normalized (output_layernorms), as in OLMo 2; needs transformer_impl='local'."""

    output_layernorms: bool = False
    """Normalize the output of attention and of the MLP before it is added to the residual stream
    (OLMo 2; with input_layernorms too, Gemma 2 and 3)."""

    qk_layernorm_per_head: bool = True
    """With qk_layernorm: normalize each query and key head. False: normalize each token's whole
    query projection and whole key projection (all heads together), as OLMo 2 does; the norm
    weights then have num_attention_heads x kv_channels and num_query_groups x kv_channels
    values."""

    local_rotary_base: Optional[int] = field(None, range="[1, 1000000000000]")
    """RoPE base of the sliding-window layers (those window_size and window_attn_skip_freq give a
    window), which then rotate without rope scaling or seq_len_interpolation_factor; the other
    layers keep rotary_base and its scaling (Gemma 3: 10000 locally, 1e6 globally). None: one
    base for all layers."""

    scale_embeddings: bool = False
    """Multiply the word embeddings by sqrt(hidden_size), the factor rounded to the embedding
    dtype (Gemma)."""

    attention_logit_softcap: Optional[float] = field(None, range=FACTOR)
    """Cap attention scores softly at +-c, c * tanh(score / c), before mask and softmax (Gemma 2);
    needs megatron-core's unfused core attention of local layers. None: no cap."""

    output_logit_softcap: Optional[float] = field(None, range=FACTOR)
    """Cap the output logits softly at +-c, c * tanh(logit / c), before the loss (Gemma 2).
    None: no cap."""

    seq_length: int = field(1024, range=SIZE)
    """Tokens per sample; must equal the dataset's sequence length."""

    vocab_size: Optional[int] = field(None, range=SIZE)
    """Vocabulary size before padding (default: the tokenizer's)."""

    should_pad_vocab: bool = True
    """Pad the vocabulary (see make_vocab_size_divisible_by)."""

    transformer_layer_spec: Optional[Union[str, Callable]] = None
    """Callable (or its import path) taking (provider, vp_stage) and returning the decoder block or
    layer spec. None: TransformerEngine layers when transformer_impl is 'transformer_engine' and TE
    is installed, else megatron-core's local layers."""

    scatter_embedding_sequence_parallel: bool = True
    """Scatter the embedding output over the sequence dimension with sequence parallelism."""

    tp_comm_overlap_cfg: Optional[Union[str, dict]] = None
    """TransformerEngine userbuffer settings for tensor-parallel communication overlap."""

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf(cls, path: str) -> "GPTModelProvider":
        """The family provider (`LlamaModelProvider`, `Qwen3ModelProvider`, ...) for a local
        Hugging Face model directory (or its config.json), every architecture field set from
        config.json. A setting the provider cannot reproduce is a `ConfigValidationError` naming
        it. Load the weights with `checkpoint.pretrained_checkpoint=path`."""
        from megatron_bridge.models.hf.config import provider_from_hf

        provider = provider_from_hf(path)
        if not isinstance(provider, cls):
            raise TypeError(f"{path} holds a {type(provider).__name__} model, not a {cls.__name__}")
        return provider

    # ------------------------------------------------------------------ finalize
    def __post_init__(self) -> None:
        """Skip megatron-core's post-init; `finalize()` runs it."""

    def _check_quantizer_factories(self, p: Problems) -> None:
        """megatron-core imports a custom FP8/FP4 recipe's quantizer factory by its path and calls
        it, so a config may only name one registered from code, as any `_target_`."""
        for name in ("fp8_quantizer_factory", "fp4_quantizer_factory"):
            path = getattr(self, name, None)
            if path is None:
                continue

            try:
                resolve(path)
            except TargetNotAllowedError as exc:
                p.add(name, f"{exc.message} (megatron-core would import and call it)", exc.fix)

    def _finalize(self, problems: Problems) -> None:
        p = problems
        self._check_quantizer_factories(p)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            # >= 1 by its declared range when set
            p.check(getattr(self, name) is not None, name, "is not set", f"set model.{name}")
        if p:
            return
        # Reported here, before megatron-core's post-init would refuse them with its own message.
        p.check(not (self.bf16 and self.fp16), "bf16", "model.bf16 and model.fp16 are both on", "choose one")
        p.check(
            self.num_moe_experts or self.expert_model_parallel_size == 1,
            "expert_model_parallel_size",
            f"expert parallelism ({self.expert_model_parallel_size}) on a model without experts "
            "(num_moe_experts is not set)",
            "set num_moe_experts or expert_model_parallel_size=1",
        )
        tp = self.tensor_model_parallel_size
        p.check(
            self.num_attention_heads % tp == 0,
            "num_attention_heads",
            f"{self.num_attention_heads} heads do not split over tensor_model_parallel_size={tp}",
            "choose a TP size that divides the number of heads",
        )
        groups = self.num_query_groups or self.num_attention_heads
        p.check(
            groups % tp == 0 or tp % groups == 0,
            "num_query_groups",
            f"{groups} query groups and tensor_model_parallel_size={tp}: neither divides the other",
            "choose a TP size that divides (or is a multiple of) num_query_groups",
        )
        if self.kv_channels is None:
            p.check(
                self.hidden_size % self.num_attention_heads == 0,
                "hidden_size",
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}",
                "set model.kv_channels explicitly or change the sizes",
            )
        p.check(
            not self.sequence_parallel or tp > 1,
            "sequence_parallel",
            "sequence parallelism needs tensor_model_parallel_size > 1",
            "set model.sequence_parallel=False or raise the TP size",
        )
        if self.symmetric_ar_type is not None:  # megatron-core's check of it reads TransformerEngine's version
            p.require_package("transformer_engine", "symmetric_ar_type", "symmetric-memory all-reduce")
        if self.multi_latent_attention:
            from megatron.core.transformer.transformer_config import MLATransformerConfig

            p.check(
                isinstance(self, MLATransformerConfig),
                "multi_latent_attention",
                f"True needs the multi-latent attention sizes (q_lora_rank, kv_lora_rank, qk_head_dim, ...), "
                f"which {type(self).__name__} does not have",
                "use a provider with them (DeepSeekModelProvider), or set model.multi_latent_attention=False",
            )
        if self.fine_grained_activation_offloading:
            p.check(
                self.transformer_impl == "transformer_engine",
                "fine_grained_activation_offloading",
                f"needs TransformerEngine layers, but transformer_impl={self.transformer_impl!r}",
                "set model.transformer_impl='transformer_engine' (and install the 'te' extra)",
            )
        if isinstance(self.transformer_layer_spec, str):
            try:
                resolve(self.transformer_layer_spec)
            except TargetNotAllowedError as exc:
                p.add("transformer_layer_spec", exc.message, exc.fix)
        self._check_layer_fields(p)
        self._check_layer_modules(p)
        self._check_expert_biases(p)
        self._check_experts(p)
        self._check_recompute(p)
        self._check_rotary(p)
        self._check_enabled_by(p)
        self._check_activation(p)

        check_attention(self, p)
        derived, note = core_attention_recompute(self)
        for name, value in derived.items():
            self._derive(name, value)
        if note:
            logger.info(note)
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            self._derive("pipeline_dtype", self.params_dtype)
        if not p:
            self._run_parent_post_init(TransformerConfig, p)

    def _check_layer_fields(self, p: Problems) -> None:
        """The layer fields megatron-core lacks are built into megatron-core's own layer spec."""
        if changes_layers(self) and self.transformer_layer_spec is not None:
            p.add(
                "transformer_layer_spec",
                "a custom layer spec is built as given, without input_layernorms=False, output_layernorms or "
                "qk_layernorm_per_head=False",
                "build those into the custom spec and leave the fields at their defaults (or unset the spec)",
            )
        p.check(
            self.input_layernorms or self.transformer_impl == "local",
            "input_layernorms",
            f"False needs megatron-core's local layers (TransformerEngine fuses these norms into the linear "
            f"layers), but transformer_impl={self.transformer_impl!r}",
            "set model.transformer_impl='local'",
        )
        if self.qk_layernorm_per_head:
            return
        p.check(
            self.qk_layernorm,
            "qk_layernorm_per_head",
            "False says how queries and keys are normalized, but qk_layernorm is False",
            "set model.qk_layernorm=True (or leave qk_layernorm_per_head at True)",
        )
        p.check(
            self.normalization == "RMSNorm",
            "qk_layernorm_per_head",
            f"False is an RMSNorm over the whole projections, but normalization={self.normalization!r}",
            "set model.normalization='RMSNorm' (or leave qk_layernorm_per_head at True)",
        )
        groups, tp = self.num_query_groups or self.num_attention_heads, self.tensor_model_parallel_size
        p.check(
            groups % tp == 0,
            "qk_layernorm_per_head",
            f"False normalizes each rank's whole key heads, but {groups} query groups do not split over "
            f"tensor_model_parallel_size={tp}",
            "choose a TP size that divides num_query_groups",
        )

    def _check_layer_modules(self, p: Problems) -> None:
        """The fields built from the project's layer modules (`models.layers`) where they apply."""
        local = self.transformer_impl == "local"
        if self.layernorm_zero_centered_gamma and local:
            p.check(
                self.normalization == "RMSNorm",
                "layernorm_zero_centered_gamma",
                f"local layers have it for RMSNorm only, but normalization={self.normalization!r}",
                "set model.normalization='RMSNorm', or use TransformerEngine layers",
            )
        if self.local_rotary_base is not None:
            for ok, message, fix in (
                (self.position_embedding_type == "rope", f"needs rotary embeddings, but position_embedding_type="
                 f"{self.position_embedding_type!r}", "set model.position_embedding_type='rope'"),
                (self.window_size is not None, "applies to the sliding-window layers, but window_size is None",
                 "set model.window_size, or leave model.local_rotary_base unset"),
                (not self.multi_latent_attention, "is not implemented for multi-latent attention",
                 "leave model.local_rotary_base unset"),
                (self.context_parallel_size == 1, f"is not implemented with context parallelism "
                 f"(context_parallel_size={self.context_parallel_size})", "set model.context_parallel_size=1"),
            ):  # fmt: skip
                p.check(ok, "local_rotary_base", message, fix)
        if self.attention_logit_softcap is not None:
            p.check(
                local,
                "attention_logit_softcap",
                f"needs megatron-core's unfused core attention of local layers, but transformer_impl="
                f"{self.transformer_impl!r}",
                "set model.transformer_impl='local'",
            )
            p.check(
                not self.apply_query_key_layer_scaling,
                "attention_logit_softcap",
                "caps the true scores, but apply_query_key_layer_scaling divides them by the layer number first",
                "set model.apply_query_key_layer_scaling=False",
            )
        custom = [
            name
            for name in ("local_rotary_base", "attention_logit_softcap")
            if getattr(self, name) is not None and self.transformer_layer_spec is not None
        ]
        for name in custom:
            p.add(
                name,
                "a custom transformer_layer_spec is built as given, without this setting",
                f"build it into the custom spec and leave model.{name} unset (or unset the spec)",
            )
    def expert_tensor_parallel(self, tp: int) -> Optional[int]:
        """The expert tensor-parallel size this model is built with where the tensor-parallel size
        is `tp`: the field where set; 1 for experts with biases (megatron-core splits no expert
        with biases); else None (megatron-core's default: `tp`)."""
        if self.expert_tensor_parallel_size is not None:
            return self.expert_tensor_parallel_size
        return 1 if self.num_moe_experts and self.add_bias_linear and tp > 1 else None

    def _check_expert_biases(self, p: Problems) -> None:
        """megatron-core adds an expert's output bias on every expert-tensor-parallel rank before
        their partial outputs are summed, so it splits no expert with biases (expert_tensor_parallel_size
        1); unset, that is derived. Its shared experts have no biases at all."""
        if not self.num_moe_experts or not self.add_bias_linear:
            return
        p.check(
            not self.moe_shared_expert_intermediate_size,
            "moe_shared_expert_intermediate_size",
            "megatron-core's shared experts have no biases, but add_bias_linear=True",
            "set model.add_bias_linear=False, or leave model.moe_shared_expert_intermediate_size unset",
        )
        etp = self.expert_tensor_parallel(self.tensor_model_parallel_size)
        if etp is not None and not self.is_explicit("expert_tensor_parallel_size"):
            self._derive("expert_tensor_parallel_size", etp)
        p.check(
            etp in (None, 1),
            "expert_tensor_parallel_size",
            f"{etp}: megatron-core splits no expert with biases (add_bias_linear=True) over tensor-parallel ranks",
            "set model.expert_tensor_parallel_size=1 (the experts are split over expert-parallel ranks instead)",
        )

    def _check_experts(self, p: Problems) -> None:
        """MoE settings megatron-core accepts in its config but fails on at the model build or the
        first forward."""
        if not self.num_moe_experts:
            return
        if self.moe_token_dispatcher_type == "flex":
            etp = self.expert_tensor_parallel(self.tensor_model_parallel_size) or self.tensor_model_parallel_size
            p.check(
                etp * self.expert_model_parallel_size > 1,
                "moe_token_dispatcher_type",
                f"'flex' dispatches over the expert tensor- and expert-parallel ranks together, and there is one "
                f"(expert_tensor_parallel_size={etp}, expert_model_parallel_size={self.expert_model_parallel_size})",
                "use 'alltoall' or 'allgather', or raise expert_model_parallel_size",
            )
        p.check(
            not self.moe_apply_probs_on_input or self.moe_router_topk == 1,
            "moe_apply_probs_on_input",
            f"megatron-core applies the routing probability to the expert input only with one expert per token, "
            f"but moe_router_topk={self.moe_router_topk}",
            "set model.moe_router_topk=1, or model.moe_apply_probs_on_input=False",
        )

    def _check_recompute(self, p: Problems) -> None:
        """megatron-core's selective recompute of a dense MLP returns the MLP's output bias (a
        parameter) through its checkpoint function, which then becomes the bias's gradient
        function: the backward pass recurses without end."""
        if self.recompute_granularity != "selective" or "mlp" not in (self.recompute_modules or ()):
            return
        freq = self.moe_layer_freq
        dense = not self.num_moe_experts or (0 in freq if isinstance(freq, list) else freq > 1 and self.num_layers > 1)
        p.check(
            not (dense and self.add_bias_linear),
            "recompute_modules",
            "'mlp' recomputes the dense MLPs, and megatron-core's MLP recompute fails with their biases "
            "(add_bias_linear=True): the backward pass recurses without end",
            "set model.add_bias_linear=False, or leave 'mlp' out of model.recompute_modules",
        )

    def _check_rotary(self, p: Problems) -> None:
        """YaRN reads only its own fields; megatron-core scales every rotary embedding's cos and
        sin by the yarn_* attention factor, so those fields stay at their defaults without it."""
        if self.position_embedding_type != "yarn":
            for name, default in _yarn_fields():
                if getattr(self, name) != default:
                    p.add(
                        name,
                        f"{getattr(self, name)!r} applies to YaRN only, but position_embedding_type="
                        f"{self.position_embedding_type!r} (megatron-core would still scale the rotary embedding by it)",
                        f"set model.position_embedding_type='yarn' or leave model.{name} at {default!r}",
                    )
            return
        ignored = {
            "rotary_percent": (self.rotary_percent == 1.0, "1.0"),
            "rotary_interleaved": (not self.rotary_interleaved, "False"),
            "seq_len_interpolation_factor": (self.seq_len_interpolation_factor is None, "None"),
            "rope_scaling": (not self.rope_scaling, "False"),
        }
        for name, (fine, value) in ignored.items():
            p.check(
                fine,
                name,
                f"{getattr(self, name)!r} is not applied with position_embedding_type='yarn' (megatron-core's "
                "YaRN embedding rotates whole heads, not interleaved, with its own scaling)",
                f"set model.{name}={value}",
            )
        p.check(
            self.yarn_rotary_scaling_factor >= 1.0,
            "yarn_rotary_scaling_factor",
            f"{self.yarn_rotary_scaling_factor} is below 1: YaRN extends the context",
            "use a factor of at least 1",
        )
        p.check(
            not self.apply_rope_fusion or self.yarn_rotary_scaling_factor == 1.0,
            "apply_rope_fusion",
            "TransformerEngine's fused rotary embedding cannot apply YaRN's attention scaling",
            "set model.apply_rope_fusion=False",
        )

    def _check_enabled_by(self, p: Problems) -> None:
        """Fields megatron-core reads only when another setting turns their feature on: changed
        from the default without it, they would do nothing."""
        for name, enabled, feature, setting in _ENABLED_BY:
            value, default = getattr(self, name), _class_default(type(self), name)
            if value != default and not enabled(self):
                p.add(
                    name,
                    f"{value!r} has no effect without {feature} ({setting}: megatron-core reads it only then)",
                    f"set {setting}, or leave model.{name} at {default!r}",
                )

    def _check_activation(self, p: Problems) -> None:
        """megatron-core's fused gated activations (bias_activation_fusion) clamp the first
        projection's output before adding its bias, and the fused SwiGLU does not clamp at all;
        unfused, the bias is added, then the clamp applied."""
        if self.activation_func_clamp_value is None or not self.bias_activation_fusion:
            return
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        why = None
        if self.activation_func is not quick_gelu:
            why = "megatron-core's fused kernel clamps only with its quick_gelu"
        elif self.add_bias_linear:
            why = "megatron-core's fused kernel clamps before adding the bias"
        p.check(
            why is None,
            "bias_activation_fusion",
            f"True with activation_func_clamp_value={self.activation_func_clamp_value}: {why}",
            "set model.bias_activation_fusion=False",
        )

    # ------------------------------------------------------------------ building
    def padded_vocab_size(self, vocab_size: Optional[int] = None) -> int:
        """Vocabulary size after padding for efficient tensor-parallel splits."""
        vocab = vocab_size if vocab_size is not None else self.vocab_size
        if vocab is None:
            raise ValueError("model.vocab_size is not set and no tokenizer vocabulary was given")
        if not self.should_pad_vocab:
            return vocab
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return int(math.ceil(vocab / multiple) * multiple)

    def layer_spec(self, vp_stage: Optional[int] = None) -> Any:
        """The decoder spec `provide()` uses (see `transformer_layer_spec`)."""
        spec = self.transformer_layer_spec
        if spec is not None:
            if isinstance(spec, str):
                spec = resolve(spec)  # a name from a config file: registered objects only
            return spec(self, vp_stage) if callable(spec) and not _is_module_spec(spec) else spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        te = self.uses_transformer_engine()
        spec = get_gpt_decoder_block_spec(
            self,
            use_transformer_engine=te,
            normalization=self.normalization,
            qk_l2_norm=self.qk_l2_norm,
            vp_stage=vp_stage,
        )
        if not te:
            choice = core_attention_choice(self)
            if not vp_stage:  # one line per model, not per virtual pipeline stage
                logger.info("%s", choice)
            module = core_attention_module(self, choice)
            if module is not None:
                spec = replace_core_attention(spec, module)
        return self.adjust_layer_spec(with_biased_experts(self, apply_layer_fields(self, spec)), vp_stage)

    def adjust_layer_spec(self, spec: Any, vp_stage: Optional[int] = None) -> Any:
        """Family hook: edit the decoder block spec (megatron-core's `TransformerBlockSubmodules`
        of this pipeline stage, the layer fields built in) and return the spec to build. Replace
        only the submodules the family changes (`models.layers.spec_edits.edit_layers`), so the
        edit composes with the others. Not called for a custom `transformer_layer_spec`."""
        return spec

    def uses_transformer_engine(self) -> bool:
        """TE layers when asked for (transformer_impl) and installed; a default ask falls back to
        local layers with a log line, an explicit one fails."""
        if self.transformer_impl != "transformer_engine":
            return False
        if extras.is_installed("transformer_engine"):
            return True
        if self.is_explicit("transformer_impl"):
            extras.require("transformer_engine", "model.transformer_impl='transformer_engine'")
        logger.info("TransformerEngine is not installed: building megatron-core local layers instead")
        return False

    def provide(self, pre_process: Optional[bool] = None, post_process: Optional[bool] = None, vp_stage: Optional[int] = None):
        """Build the `GPTModel` of this pipeline stage (and virtual stage `vp_stage`); a provider
        not finalized yet is finalized first (megatron-core's layers need its derived values)."""
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel

        if not self.is_finalized():
            self.finalize()

        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        if self.num_moe_experts:
            _router_gating_without_te()
        _output_discarding_checkpoint_without_te()

        spec = self.layer_spec(vp_stage)
        with _te_attention_variables(te_layers(self)):
            model = self._gpt_model(GPTModel, spec, pre_process, post_process, vp_stage)
        if self.scale_embeddings and hasattr(model, "embedding"):
            scale_word_embeddings(model, self.hidden_size)
        if self.output_logit_softcap is not None and post_process:
            cap_output_logits(model, self.output_logit_softcap)
        return model

    def _gpt_model(self, GPTModel: type, spec: Any, pre_process: bool, post_process: bool, vp_stage: Optional[int]):
        mtp = None
        if self.mtp_num_layers:  # multi-token prediction: layers after the last decoder layer, on the last stage
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp = get_gpt_mtp_block_spec(self, spec, use_transformer_engine=te_layers(self), vp_stage=vp_stage)
        return GPTModel(
            config=self,
            transformer_layer_spec=spec,
            vocab_size=self.padded_vocab_size(),
            max_sequence_length=self.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            fp16_lm_cross_entropy=self.fp16_lm_cross_entropy,
            parallel_output=self.parallel_output,
            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
            position_embedding_type=self.position_embedding_type,
            rotary_percent=self.rotary_percent,
            rotary_base=self.rotary_base,
            rope_scaling=self.rope_scaling,
            rope_scaling_factor=self.rope_scaling_factor,
            scatter_embedding_sequence_parallel=self.scatter_embedding_sequence_parallel,
            seq_len_interpolation_factor=self.seq_len_interpolation_factor,
            mtp_block_spec=mtp,
            vp_stage=vp_stage,
        )


_ENABLED_BY: tuple[tuple[str, Callable[[Any], bool], str, str], ...] = (
    ("rope_scaling_factor", lambda m: m.rope_scaling, "Llama 3.1's rope scaling", "model.rope_scaling=True"),
    ("mrope_section", lambda m: m.position_embedding_type == "mrope", "multimodal rope",
     "model.position_embedding_type='mrope'"),
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
)  # fmt: skip
"""(field, whether its feature is on, the feature, the setting that turns it on): `_check_enabled_by`."""


@functools.cache
def _class_default(cls: type, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


_TE_ATTENTION_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@functools.cache
def _yarn_fields() -> tuple[tuple[str, object], ...]:
    """(name, default) of the YaRN fields, which apply only with position_embedding_type='yarn'."""
    return tuple((f.name, f.default) for f in dataclasses.fields(GPTModelProvider) if f.name.startswith("yarn_"))


@contextlib.contextmanager
def _te_attention_variables(te: bool) -> Iterator[None]:
    """megatron-core's GPTModel sets TransformerEngine's attention variables from
    attention_backend, and asserts when an earlier model of the process set them otherwise.
    Local layers do not read them: around their build the environment stays as it was."""
    if te:
        yield
        return
    saved = {name: os.environ.pop(name) for name in _TE_ATTENTION_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        for name in _TE_ATTENTION_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(saved)


def _router_gating_without_te() -> None:
    """megatron-core 0.16's MoE router gating refers to TransformerEngine's GEMM even where TE is
    not installed (a NameError at the first forward); there, None selects its torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _output_discarding_checkpoint_without_te() -> None:
    """megatron-core 0.16's `CheckpointWithoutOutput` (recompute_modules 'layernorm' and 'moe_act')
    saves and restores TransformerEngine's FP8 state even where TE is not installed (a NameError
    at the first forward): `fp8 is not None` holds for its default fp8=False. Without TE there is
    no FP8 state, so its FP8 handling is turned off."""
    from megatron.core.tensor_parallel import random as core_random

    cls = core_random.CheckpointWithoutOutput
    if core_random.HAVE_TE or getattr(cls, "_fp8_off_without_te", False):
        return
    original_init = cls.__init__

    def __init__(self, fp8=False):
        original_init(self, fp8)
        self.fp8 = False

    cls.__init__ = __init__
    cls._fp8_off_without_te = True


def _is_module_spec(obj: Any) -> bool:
    from megatron.core.transformer.spec_utils import ModuleSpec

    return isinstance(obj, ModuleSpec)
