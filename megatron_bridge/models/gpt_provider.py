"""`GPTModelProvider`: a GPT architecture as a config, and the builder of its megatron-core model."""

from __future__ import annotations

import contextlib
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
from megatron_bridge.models.layers.spec_edits import apply_layer_fields
from megatron_bridge.models.provider_checks import (
    check_activation,
    check_enabled_by,
    check_expert_biases,
    check_experts,
    check_layer_fields,
    check_layer_modules,
    check_recompute,
    check_rotary,
)
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
        if not self.multi_latent_attention:  # multi-latent attention has no query groups
            p.check(
                self.num_attention_heads % groups == 0,
                "num_query_groups",
                f"{groups} query groups do not divide num_attention_heads={self.num_attention_heads} "
                "(megatron-core fails on it at the first forward pass)",
                "choose num_query_groups that divides num_attention_heads",
            )
        p.check(
            not self.sequence_parallel or tp > 1,
            "sequence_parallel",
            "sequence parallelism needs tensor_model_parallel_size > 1",
            "set model.sequence_parallel=False or raise the TP size",
        )
        interleaved = self.pipeline_model_parallel_size > 1 and (self.virtual_pipeline_model_parallel_size or 1) > 1
        p.check(
            not (interleaved and self.overlap_p2p_comm and self.batch_p2p_comm),
            "overlap_p2p_comm",
            "True with batch_p2p_comm=True: megatron-core's interleaved pipeline schedule refuses the two together "
            "(at the first training step)",
            "set model.batch_p2p_comm=False, or model.overlap_p2p_comm=False",
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
        check_layer_fields(self, p)
        check_layer_modules(self, p)
        check_expert_biases(self, p)
        check_experts(self, p)
        check_recompute(self, p)
        check_rotary(self, p)
        check_enabled_by(self, p)
        check_activation(self, p)

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

    def expert_tensor_parallel(self, tp: int) -> Optional[int]:
        """The expert tensor-parallel size this model is built with where the tensor-parallel size
        is `tp`: the field where set; 1 for experts with biases (megatron-core splits no expert
        with biases); else None (megatron-core's default: `tp`)."""
        if self.expert_tensor_parallel_size is not None:
            return self.expert_tensor_parallel_size
        return 1 if self.num_moe_experts and self.add_bias_linear and tp > 1 else None

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


_TE_ATTENTION_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


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
