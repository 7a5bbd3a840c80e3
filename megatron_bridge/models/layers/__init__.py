"""Layer-spec building blocks that megatron-core's layer specs lack, as project modules.

* `output_norm.NormedBiasDropoutAdd` (spec: `normed_bda(config, norm)`): megatron-core's
  bias-dropout-add with a norm in front, as the layer's `self_attn_bda` / `mlp_bda`: the norms
  after attention and MLP of OLMo 2 and Gemma 2/3, for any attention and MLP (dense or MoE,
  local or TransformerEngine).
* `projection_norm.ProjectionNorm`: RMSNorm over a token's whole query (or key) projection, all
  heads together (OLMo 2's qk-norm), exact under tensor parallelism.
* `zero_centered_norm.ZeroCenteredRMSNorm`: RMSNorm with its weight stored as `gamma - 1`
  (megatron-core's `layernorm_zero_centered_gamma`, which its local norms lack; Gemma 2/3).
* `local_rotary.LocalRotarySelfAttention`: sliding-window layers rotated with a RoPE base of
  their own (`local_rotary_base`, Gemma 3).
* `embedding_scale`: word embeddings times sqrt(hidden_size) (`scale_embeddings`, Gemma).
* `softcap`: soft-capped attention scores and output logits (`attention_logit_softcap`,
  `output_logit_softcap`, Gemma 2).
* `expert_bias.BiasedSequentialMLP`: megatron-core's sequential experts for experts with biases
  (GPT-OSS), whose own in-place weighted bias add fails under autograd; put in place of
  `SequentialMLP` whenever the experts have biases.
* `spec_edits`: editing a built decoder block spec layer by layer, and `apply_layer_fields`,
  which builds the provider fields `input_layernorms`, `output_layernorms`,
  `qk_layernorm_per_head`, `layernorm_zero_centered_gamma` and `local_rotary_base` into the spec
  `GPTModelProvider.layer_spec` returns.
"""
