"""What our configs declare about the fields they inherit from megatron-core's config classes:
the range of each numeric field (`RANGES`, grouped by range) and the fields whose status is not
"used" (`STATUS`), both keyed by the megatron-core class that declares the field. A field our
class declares again (with its own `field(range=...)`) takes the declaration of our class.
"""

from __future__ import annotations

from megatron_bridge.config.fields import (
    ANY,
    COUNT,
    DERIVED,
    FACTOR,
    LEARNING_RATE,
    LOSS_WEIGHT,
    POSITIVE,
    PROBABILITY,
    SEED,
    SIZE,
    STEPS,
    WEIGHT_DECAY,
    WEIGHT_STD,
    Range,
    Unsupported,
    parse,
)

_RANGES_BY_CLASS: dict[str, tuple[tuple[str, str], ...]] = {  # class -> (range, the fields that have it)
    "ModelParallelConfig": (
        (SIZE, "tensor_model_parallel_size pipeline_model_parallel_size virtual_pipeline_model_parallel_size "
        "context_parallel_size expert_model_parallel_size expert_tensor_parallel_size"),
        (COUNT, "num_microbatches_with_partial_activation_checkpoints wgrad_deferral_limit cpu_offloading_num_layers"),
        (STEPS, "hierarchical_context_parallel_sizes max_seqlen_per_dp_cp_rank microbatch_group_size_per_vp_stage"),
    ),
    "TransformerConfig": (
        (SIZE, "num_layers hidden_size num_attention_heads num_query_groups ffn_hidden_size kv_channels "
        "num_moe_experts moe_ffn_hidden_size moe_shared_expert_intermediate_size moe_router_topk "
        "moe_router_num_groups moe_latent_size moe_deepep_num_sms moe_hybridep_num_sms "
        "dsa_indexer_n_heads dsa_indexer_head_dim linear_conv_kernel_dim linear_key_head_dim "
        "linear_value_head_dim linear_num_key_heads linear_num_value_heads fp8_interval fp8_amax_history_len "
        "mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads num_layers_in_first_pipeline_stage "
        "num_layers_in_last_pipeline_stage"),
        (COUNT, "mtp_num_layers "
        "recompute_num_layers num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 window_attn_skip_freq "
        "no_rope_freq linear_attention_freq moe_layer_freq moe_router_topk_limited_devices moe_router_group_topk "
        "dsa_indexer_topk"),
        (STEPS, "cuda_graph_warmup_steps mrope_section mlp_chunks_for_prefill min_offloaded_tensor_size"),
        (PROBABILITY, "hidden_dropout attention_dropout moe_router_bias_update_rate moe_input_jitter_eps"),
        (LOSS_WEIGHT, "mtp_loss_scaling_factor dsa_indexer_loss_coeff moe_aux_loss_coeff moe_z_loss_coeff"),
        (WEIGHT_STD, "init_method_std embedding_init_method_std"),
        (FACTOR, "moe_router_topk_scaling_factor moe_expert_capacity_factor"),
        (POSITIVE, "activation_func_clamp_value qk_clip_threshold"),
        ("[0, inf)", "qk_clip_alpha"),
        ("(0, 100]", "softmax_scale"),
        ("(0, 1]", "layernorm_epsilon"),
        ("[-1, 2**31)", "window_size"),  # -1: unbounded on that side
        ("[-128, 128]", "fp8_margin"),
        (ANY, "glu_linear_offset"),
        (SEED, "inference_sampling_seed"),
    ),
    "MLATransformerConfig": (
        (SIZE, "q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim original_max_position_embeddings"),
        (FACTOR, "rotary_scaling_factor beta_fast beta_slow"),
        ("[0, 100]", "mscale mscale_all_dim"),
    ),
    "BlendedMegatronDatasetConfig": (
        (SEED, "random_seed"),
        (COUNT, "num_dataset_builder_threads"),
        (SIZE, "sequence_length"),
        (PROBABILITY, "split_matrix"),
        ("[0, 10]", "mid_level_dataset_surplus"),
    ),
    "GPTDatasetConfig": (
        (SIZE, "data_parallel_size context_parallel_size"),
        (COUNT, "sequence_parallel_size"),
        ("[1, 16]", "token_dtype_code"),  # bytes per token id
    ),
    "DistributedDataParallelConfig": (
        (SIZE, "num_distributed_optimizer_instances suggested_communication_unit_size"),
        ("[1, 2**63)", "bucket_size"),
    ),
    "OptimizerConfig": (
        (LEARNING_RATE, "lr min_lr decoupled_lr decoupled_min_lr"),
        (WEIGHT_DECAY, "weight_decay"),
        ("[0, 1)", "adam_beta1 adam_beta2 sgd_momentum muon_momentum"),
        ("(0, 1]", "adam_eps"),
        (PROBABILITY, "optimizer_offload_fraction"),
        ("[0, 1000000]", "clip_grad"),
        ("(0, 2**32]", "loss_scale min_loss_scale"),
        ("(0, 2**64]", "initial_loss_scale"),
        ("[1, 2**31)", "loss_scale_window hysteresis"),
        (STEPS, "muon_num_ns_steps"),
        (FACTOR, "muon_extra_scale_factor"),
    ),
}

RANGES: dict[str, Range] = {
    f"{cls}.{name}": parse(spec) for cls, by_range in _RANGES_BY_CLASS.items() for spec, names in by_range
    for name in names.split()
}  # fmt: skip
"""`Class.field` -> the range of a numeric megatron-core field."""

NEEDS_TE = Unsupported("needs TransformerEngine", needs="transformer_engine")
NEEDS_GPU = Unsupported("needs a GPU (CUDA graphs)", needs="gpu")
_FSDP_ONLY = Unsupported("read only by Megatron FSDP, which is not wired into the model build")
_HYBRID_CP = Unsupported(
    "not implemented: megatron-core's hybrid context parallelism trains on the sub-sample batches of its "
    "HybridCPDataLoaderWrapper, which the data pipeline does not build"
)
_QK_CLIP = Unsupported(
    "not implemented: the training loop does not call megatron-core's clip_qk, and only TransformerEngine's "
    "core attention records the attention logits it reads"
)

STATUS: dict[str, object] = {
    **{f"TransformerConfig.{name}": NEEDS_TE for name in ("fp8", "fp4")},
    # megatron-core offloads activations through TransformerEngine's offload context only
    "ModelParallelConfig.cpu_offloading": NEEDS_TE,
    # TransformerEngine's kernels and layers: fused rotary embedding, MoE permutation and routing, latent projections
    **{
        f"TransformerConfig.{name}": NEEDS_TE
        for name in ("fused_single_qkv_rope", "moe_permute_fusion", "moe_router_fusion", "moe_latent_size")
    },
    **{f"TransformerConfig.{name}": NEEDS_GPU for name in ("enable_cuda_graph", "cuda_graph_impl", "external_cuda_graph")},
    # megatron-core hooks that the build wires onto the model's and the optimizer's copies of the config
    **{
        f"ModelParallelConfig.{name}": DERIVED
        for name in ("timers", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
                     "finalize_model_grads_func")
    },  # fmt: skip
    "OptimizerConfig.timers": DERIVED,
    **{f"ModelParallelConfig.{name}": _HYBRID_CP for name in ("hybrid_context_parallel", "max_seqlen_per_dp_cp_rank")},
    "GPTDatasetConfig.hybrid_context_parallel": _HYBRID_CP,
    **{
        f"TransformerConfig.{name}": Unsupported(
            "not implemented: per-layer block configs (megatron-core's HeterogeneousTransformerConfig) are not a "
            "model provider here"
        )
        for name in ("heterogeneous_block_specs", "hetereogenous_dist_checkpoint")
    },
    **{
        f"TransformerConfig.{name}": Unsupported(
            "not implemented: NVIDIA Kitchen's quantized layers are not an integration here (megatron-core "
            "asserts at the model build without the package)"
        )
        for name in ("use_kitchen", "use_kitchen_attention", "kitchen_attention_backend")
    },
    **{
        f"TransformerConfig.{name}": Unsupported(
            "not implemented: the model build uses megatron-core's GPT layer specs, not its experimental attention "
            "variants (DSA, gated delta net)"
        )
        for name in ("experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
                     "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "linear_attention_freq",
                     "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads")
    },  # fmt: skip
    "TransformerConfig.apply_residual_connection_post_layernorm": Unsupported(
        "not implemented: megatron-core 0.16's transformer layer does not read it (the residual is always the layer input)"
    ),
    **{f"TransformerConfig.{name}": _QK_CLIP for name in ("qk_clip", "qk_clip_alpha", "qk_clip_threshold", "log_max_attention_logit")},
    "DistributedDataParallelConfig.use_megatron_fsdp": Unsupported(
        "not implemented: Megatron FSDP is not wired into the model build; use use_distributed_optimizer"
    ),
    **{
        f"DistributedDataParallelConfig.{name}": _FSDP_ONLY
        for name in ("use_custom_fsdp", "data_parallel_sharding_strategy", "gradient_reduce_div_fusion",
                     "suggested_communication_unit_size", "preserve_fp32_weights", "keep_fp8_transpose_cache",
                     "fsdp_double_buffer", "outer_dp_sharding_strategy", "fsdp_manual_registration")
    },  # fmt: skip
}
"""`Class.field` -> the status of a megatron-core field that is not simply used."""
