"""What the planner reads from a resolved config: plain numbers, copied once.

The planner never touches the `ConfigContainer` after `PlanInputs.from_config`: fixes are
`dataclasses.replace` of these inputs (cheap), not copies of the config (slow).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional
from megatron_bridge.peft import targets as tg

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


MAX_LAYERS = 10_000
"""The deepest model the planner plans: a billion layers built per-layer tuples until MemoryError."""


class PlanningError(ValueError):
    """The config uses a feature the planner does not model (the message names it)."""


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype (or its name)."""
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise PlanningError(f"dtype {dtype} is not modeled by the planner")
    return _DTYPE_BYTES[name]


@dataclass(frozen=True)
class PlanInputs:
    """Everything the memory and time model needs, as plain values."""

    # ---- architecture
    num_layers: int
    hidden: int
    heads: int
    query_groups: int
    kv_channels: int
    ffn: int
    gated: bool
    linear_bias: bool
    qkv_bias: bool
    attention_sinks: bool
    """A learned softmax offset per head (softmax_type='learnable')."""
    qk_layernorm: bool
    qk_norm_per_head: bool
    input_norms: bool
    output_norms: bool
    norm_has_bias: bool
    vocab_size: int
    make_vocab_divisible_by: int
    pad_vocab: bool
    seq_length: int
    learned_positions: bool
    tied_embeddings: bool
    hidden_dropout: float
    attention_dropout: float
    # ---- mixture of experts (num_experts 0: dense)
    num_experts: int
    topk: int
    moe_ffn: int
    shared_expert_ffn: int
    shared_expert_gate: bool
    moe_layer_pattern: tuple[bool, ...]
    moe_grouped_gemm: bool
    # ---- layout
    world_size: int
    tp: int
    pp: int
    vp: Optional[int]
    cp: int
    ep: int
    etp: int
    microbatch_group_size: Optional[int]
    sequence_parallel: bool
    layers_first_stage: Optional[int]
    layers_last_stage: Optional[int]
    embedding_in_pipeline_split: bool
    loss_in_pipeline_split: bool
    transformer_engine: bool
    """TransformerEngine layers (see `layers_note` for why these layers)."""
    # ---- what the layers keep for backward (megatron-core's local layers read these)
    core_attention: str
    """'te' (TransformerEngine's), 'sdpa' (PyTorch scaled_dot_product_attention) or 'unfused'
    (megatron-core's DotProductAttention, which materializes the scores)."""
    layers_note: str
    """Why these layers and this core attention (for the plan's header)."""
    local_core_attention: str
    """The core attention of this config without context parallelism: 'sdpa' or 'unfused' on
    local layers, 'te' where TransformerEngine layers are built anyway."""
    softmax_in_fp32: bool
    activation_fused: bool
    """megatron-core's fused bias-activation (bias_activation_fusion): it keeps only its input."""
    rotary_dim: int
    """Channels per head that RoPE rotates (0: no rotary embedding)."""
    wgrad_fusion: bool
    """Weight gradients accumulate straight into the gradient buffer (gradient_accumulation_fusion)."""
    attention_masks: tuple[bool, ...]
    """Per layer: a mask tensor reaches the core attention (a sliding window shorter than the
    sequence, packed samples, or masks from the dataset); plain causal attention needs none."""
    mask_per_sample: bool
    """The mask has one [s, s] plane per sample (packed or dataset masks), not one for the batch."""
    # ---- parameter-efficient fine-tuning (peft None: every parameter trains)
    peft: Optional[str]
    """'lora' or 'dora': the base is frozen and only adapters train."""
    peft_dim: int
    peft_dropout: float
    peft_dropout_position: str
    peft_modules: tuple[tuple[str, ...], ...]
    """Per layer: the adapted linear layers, named relative to the layer (global expert numbers)."""
    # ---- precision
    precision: str
    """'bf16', 'fp16' or the parameter dtype (e.g. 'float32')."""
    param_bytes: int
    activation_bytes: int
    fp8_params: bool
    grad_reduce_in_fp32: bool
    # ---- recompute
    recompute_granularity: Optional[str]
    recompute_method: Optional[str]
    recompute_num_layers: Optional[int]
    recompute_modules: tuple[str, ...]
    # ---- data parallel and optimizer
    distributed_optimizer: bool
    num_dist_opt_instances: int
    overlap_grad_reduce: bool
    bucket_size: Optional[int]
    pad_buckets_for_high_nccl_busbw: bool
    optimizer: str
    sgd_momentum: float
    precision_aware: bool
    main_params_bytes: int
    exp_avg_bytes: int
    exp_avg_sq_bytes: int
    store_param_remainders: bool
    cpu_offload_fraction: float
    torch_optimizer: bool
    # ---- batch and length
    micro_batch_size: int
    global_batch_size: int
    train_iters: Optional[int]
    # ---- multi-latent attention (mla False: megatron-core's fused query/key/value projection)
    mla: bool = False
    q_lora_rank: int = 0
    """Rank of the low-rank query projection (0: one full query projection)."""
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    """Per head: query/key dimensions without rotary embeddings."""
    qk_rope_dim: int = 0
    """Per head: query/key dimensions with rotary embeddings (the keys' are shared over heads)."""
    v_head_dim: int = 0
    mla_fused_norms: bool = False
    """TransformerEngine layers with the latent norms fused into the up projections."""
    # ---- multi-token prediction (mtp_depths 0: none)
    mtp_depths: int = 0
    """megatron-core's multi-token prediction layers (mtp_num_layers), on the last pipeline stage after
    the last decoder layer: per depth two norms, a 2h -> h projection, one transformer layer of the
    kind of the last decoder layer, a final norm, and logits and loss of their own."""
    mtp_masks: tuple[bool, ...] = ()
    """Per depth: a mask tensor reaches its transformer layer's core attention (as `attention_masks`)."""

    # ------------------------------------------------------------------ derived
    @property
    def dp(self) -> int:
        """Data-parallel size (dense parameters)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of expert parameters: world / (ETP x EP x PP)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def padded_vocab(self) -> int:
        if not self.pad_vocab:
            return self.vocab_size
        multiple = self.make_vocab_divisible_by * self.tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def num_microbatches(self) -> int:
        return max(1, self.global_batch_size // (self.micro_batch_size * self.dp))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def __hash__(self) -> int:
        # Inputs key the planner's caches; hashing ~80 fields on every lookup would dominate.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def state_key(self) -> tuple:
        """The fields that parameter, gradient and optimizer bytes depend on besides the
        architecture (recompute, micro batch and sequence parallelism change only activations)."""
        return (
            self.world_size,
            self.tp,
            self.pp,
            self.vp,
            self.cp,
            self.ep,
            self.etp,
            self.distributed_optimizer,
            self.precision_aware,
            self.main_params_bytes,
            self.exp_avg_bytes,
            self.exp_avg_sq_bytes,
            self.store_param_remainders,
            self.cpu_offload_fraction,
            self.overlap_grad_reduce,
            self.bucket_size,
        )

    def replace(self, **changes: Any) -> "PlanInputs":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ from a config
    @classmethod
    def from_config(cls, cfg: Any, world_size: Optional[int] = None) -> "PlanInputs":
        """Read a config resolved by `runtime_config_update` (`data_parallel_size` set)."""
        m, ddp, opt, t = cfg.model, cfg.ddp, cfg.optimizer, cfg.train
        if m.num_layers > MAX_LAYERS:
            raise PlanningError(
                f"model.num_layers={m.num_layers:,} is deeper than the planner models (at most {MAX_LAYERS:,} layers: "
                "its plans hold each layer, and the deepest real models have a few hundred)"
            )
        if getattr(m, "pipeline_model_parallel_layout", None) is not None:
            raise PlanningError(
                "model.pipeline_model_parallel_layout (custom stage layouts) is not modeled by the planner"
            )
        mtp_depths = getattr(m, "mtp_num_layers", None) or 0
        if mtp_depths and getattr(cfg, "peft", None) is not None:
            raise PlanningError(
                "LoRA/DoRA with multi-token prediction (model.mtp_num_layers) is not modeled by the planner"
            )
        if mtp_depths and m.recompute_granularity == "full" and m.recompute_method == "uniform":
            if (m.recompute_num_layers or 1) != 1:
                raise PlanningError(
                    "multi-token prediction with full uniform recompute of "
                    f"model.recompute_num_layers={m.recompute_num_layers} layers is not modeled by the planner "
                    "(megatron-core recomputes its layers one at a time only: model.recompute_num_layers=1)"
                )
        if (
            getattr(ddp, "use_megatron_fsdp", False)
            or getattr(ddp, "use_custom_fsdp", False)
            or cfg.dist.use_torch_fsdp2
        ):
            raise PlanningError("FSDP sharding of parameters and gradients is not modeled by the planner")
        if cfg.data_parallel_size is None and world_size is None:
            raise PlanningError("the config is not resolved: call runtime_config_update(cfg) first")
        tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
        world = world_size if world_size is not None else cfg.data_parallel_size * tp * pp * cp
        vocab = m.vocab_size if m.vocab_size is not None else cfg.tokenizer.vocab_size
        if vocab is None:
            raise PlanningError("the vocabulary size is unknown (set model.vocab_size or tokenizer.vocab_size)")
        heads = m.num_attention_heads
        experts = m.num_moe_experts or 0
        pattern = _moe_pattern(m, experts)
        bf16, fp16 = bool(m.bf16), bool(m.fp16)
        param_bytes = 2 if (bf16 or fp16) else dtype_bytes(m.params_dtype)
        fp8_params = bool(m.fp8) and bool(m.fp8_param)
        aware = bool(opt.use_precision_aware_optimizer)
        offload = float(opt.optimizer_offload_fraction) if opt.optimizer_cpu_offload else 0.0
        from megatron.core import optimizer as mcore_optimizer

        te, core, note = _layers(m)
        local_core = core if m.context_parallel_size == 1 else _layers(m, without_cp=True)[1]
        masks, per_sample = _attention_masks(cfg, mtp_depths)
        peft = getattr(cfg, "peft", None)
        return cls(
            num_layers=m.num_layers,
            hidden=m.hidden_size,
            heads=heads,
            query_groups=m.num_query_groups or heads,
            kv_channels=m.kv_channels or m.hidden_size // heads,
            ffn=m.ffn_hidden_size or 4 * m.hidden_size,
            gated=bool(m.gated_linear_unit),
            linear_bias=bool(m.add_bias_linear),
            qkv_bias=bool(m.add_bias_linear or getattr(m, "add_qkv_bias", False)),
            attention_sinks=getattr(m, "softmax_type", "vanilla") == "learnable",
            qk_layernorm=bool(m.qk_layernorm),
            qk_norm_per_head=bool(m.qk_layernorm_per_head),
            input_norms=bool(m.input_layernorms),
            output_norms=bool(m.output_layernorms),
            norm_has_bias=m.normalization != "RMSNorm",
            vocab_size=int(vocab),
            make_vocab_divisible_by=m.make_vocab_size_divisible_by,
            pad_vocab=bool(m.should_pad_vocab),
            seq_length=m.seq_length,
            learned_positions=m.position_embedding_type == "learned_absolute",
            tied_embeddings=bool(m.share_embeddings_and_output_weights),
            hidden_dropout=float(m.hidden_dropout or 0.0),
            attention_dropout=float(m.attention_dropout or 0.0),
            num_experts=experts,
            topk=m.moe_router_topk or 0,
            moe_ffn=(m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size) if experts else 0,
            shared_expert_ffn=(m.moe_shared_expert_intermediate_size or 0) if experts else 0,
            shared_expert_gate=bool(getattr(m, "moe_shared_expert_gate", False)),
            moe_layer_pattern=pattern,
            moe_grouped_gemm=bool(m.moe_grouped_gemm),
            world_size=world,
            tp=tp,
            pp=pp,
            vp=m.virtual_pipeline_model_parallel_size if pp > 1 else None,
            cp=cp,
            ep=m.expert_model_parallel_size or 1,
            etp=(m.expert_tensor_parallel_size if m.expert_tensor_parallel_size is not None else tp) if experts else tp,
            microbatch_group_size=_explicit(m, "microbatch_group_size_per_vp_stage"),
            sequence_parallel=bool(m.sequence_parallel),
            layers_first_stage=m.num_layers_in_first_pipeline_stage,
            layers_last_stage=m.num_layers_in_last_pipeline_stage,
            embedding_in_pipeline_split=bool(m.account_for_embedding_in_pipeline_split),
            loss_in_pipeline_split=bool(m.account_for_loss_in_pipeline_split),
            transformer_engine=te,
            core_attention=core,
            layers_note=note,
            local_core_attention=local_core,
            softmax_in_fp32=bool(m.attention_softmax_in_fp32),
            activation_fused=bool(m.bias_activation_fusion),
            rotary_dim=_rotary_dim(m),
            wgrad_fusion=bool(m.gradient_accumulation_fusion),
            attention_masks=masks[: m.num_layers],
            mask_per_sample=per_sample,
            peft=None if peft is None else ("dora" if peft.method_name == "DoRA" else "lora"),
            peft_dim=peft.dim if peft is not None else 0,
            peft_dropout=float(peft.dropout) if peft is not None else 0.0,
            peft_dropout_position=peft.dropout_position if peft is not None else "pre",
            peft_modules=adapted_modules(m, peft) if peft is not None else (),
            precision="bf16" if bf16 else "fp16" if fp16 else str(m.params_dtype).replace("torch.", ""),
            param_bytes=param_bytes,
            activation_bytes=2 if (bf16 or fp16) else dtype_bytes(m.params_dtype),
            fp8_params=fp8_params,
            grad_reduce_in_fp32=bool(ddp.grad_reduce_in_fp32),
            recompute_granularity=m.recompute_granularity,
            recompute_method=m.recompute_method,
            recompute_num_layers=m.recompute_num_layers,
            recompute_modules=tuple(m.recompute_modules or ("core_attn",)),
            distributed_optimizer=bool(ddp.use_distributed_optimizer),
            num_dist_opt_instances=ddp.num_distributed_optimizer_instances or 1,
            overlap_grad_reduce=bool(ddp.overlap_grad_reduce),
            bucket_size=ddp.bucket_size,
            pad_buckets_for_high_nccl_busbw=bool(ddp.pad_buckets_for_high_nccl_busbw),
            optimizer=opt.optimizer,
            sgd_momentum=float(opt.sgd_momentum or 0.0),
            precision_aware=aware,
            main_params_bytes=dtype_bytes(opt.main_params_dtype) if aware else 4,
            exp_avg_bytes=dtype_bytes(opt.exp_avg_dtype) if aware else 4,
            exp_avg_sq_bytes=dtype_bytes(opt.exp_avg_sq_dtype) if aware else 4,
            store_param_remainders=bool(opt.store_param_remainders) and aware,
            cpu_offload_fraction=offload,
            torch_optimizer=bool(getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", True)),
            micro_batch_size=t.micro_batch_size,
            global_batch_size=t.global_batch_size,
            train_iters=t.train_iters,
            mtp_depths=mtp_depths,
            mtp_masks=masks[m.num_layers :],
            **_mla_inputs(m, te),
        )


def _mla_inputs(m: Any, te: bool) -> dict[str, Any]:
    """The multi-latent attention sizes of model config `m` (none without MLA); `te`: it is
    planned on TransformerEngine layers."""
    if not getattr(m, "multi_latent_attention", False):
        return {}
    return dict(
        mla=True,
        q_lora_rank=m.q_lora_rank or 0,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_rope_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        # the latent norms are fused unless they have an epsilon of their own (models.layers.latent_attention)
        mla_fused_norms=te and getattr(m, "latent_layernorm_epsilon", m.layernorm_epsilon) == m.layernorm_epsilon,
    )


def _layers(m: Any, without_cp: bool = False) -> tuple[bool, str, str]:
    """(TransformerEngine layers, core attention kind, why): what `provide()` builds here. Where
    local layers cannot run the config at all (context parallelism has no local core attention),
    the plan is of the TransformerEngine layers that can, and says so."""
    import copy

    from megatron_bridge.models.attention import core_attention_choice

    if without_cp and m.context_parallel_size > 1:
        m = copy.copy(m)
        m.context_parallel_size = 1
    choice = core_attention_choice(m)
    if choice.kind == "unfused" and m.context_parallel_size > 1:
        return True, "te", context_parallel_note(m.context_parallel_size)
    return choice.kind == "te", choice.kind, choice.reason


def context_parallel_note(cp: int) -> str:
    return (
        f"context_parallel_size={cp} runs only on TransformerEngine layers (megatron-core's local attention has no "
        "context parallelism); TransformerEngine is not installed here"
    )


def _rotary_dim(m: Any) -> int:
    if m.position_embedding_type != "rope":
        return 0
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    return int(kv * m.rotary_percent)


def _attention_masks(cfg: Any, mtp_depths: int = 0) -> tuple[tuple[bool, ...], bool]:
    """Which layers hand a mask tensor to the core attention, and whether it is per sample; after
    the decoder's layers, the transformer layers of the `mtp_depths` multi-token prediction depths
    (megatron-core numbers them on after the decoder's)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    m, data = cfg.model, cfg.dataset
    packed = getattr(data, "packed_sequence_specs", None) is not None
    from_dataset = not getattr(data, "skip_getting_attention_mask_from_dataset", True)
    window = m.window_size
    shorter = window is not None and 0 <= int(window[0]) < m.seq_length - 1
    masks = tuple(
        packed or from_dataset or (shorter and is_layer_window_attention(window, m.window_attn_skip_freq, i + 1))
        for i in range(m.num_layers + mtp_depths)
    )
    return masks, packed or from_dataset


def adapted_modules(m: Any, peft: Any) -> tuple[tuple[str, ...], ...]:
    """Per layer, the linear layers `peft`'s targets select, relative to the layer
    (`self_attention.linear_qkv`, `mlp.experts.local_experts.3.linear_fc1`, ...)."""
    selected, _ = tg.match_targets(peft.target_modules, tg.expected_names(m))
    per_layer: list[list[str]] = [[] for _ in range(m.num_layers)]
    for name in selected:
        _, _, layer, rest = name.split(".", 3)  # decoder.layers.<L>.<rest>
        per_layer[int(layer)].append(rest)
    return tuple(tuple(names) for names in per_layer)


def _explicit(section: Any, name: str) -> Any:
    """The value of `name` if the user chose it, None if it is derived (it then follows the layout)."""
    is_explicit = getattr(section, "is_explicit", None)
    if is_explicit is not None and not is_explicit(name):
        return None
    return getattr(section, name, None)


def _moe_pattern(m: Any, experts: int) -> tuple[bool, ...]:
    """Which layers are mixture-of-experts layers (megatron-core's reading of moe_layer_freq)."""
    if not experts:
        return (False,) * m.num_layers
    freq = m.moe_layer_freq
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(m.num_layers))
    return tuple(bool(x) for x in freq)
