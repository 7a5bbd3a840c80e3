"""Layer-spec building blocks that megatron-core's layer specs lack, as project modules.

* `output_norm.NormedBiasDropoutAdd` (spec: `normed_bda(config, norm)`): megatron-core's
  bias-dropout-add with a norm in front, as the layer's `self_attn_bda` / `mlp_bda`: the norms
  after attention and MLP of OLMo 2 and Gemma 2/3, for any attention and MLP (dense or MoE,
  local or TransformerEngine).
* `projection_norm.ProjectionNorm`: RMSNorm over a token's whole query (or key) projection, all
  heads together (OLMo 2's qk-norm), exact under tensor parallelism.
* `expert_bias.BiasedSequentialMLP`: megatron-core's sequential experts for experts with biases
  (GPT-OSS), whose own in-place weighted bias add fails under autograd; put in place of
  `SequentialMLP` whenever the experts have biases.
* `spec_edits`: editing a built decoder block spec layer by layer, and `apply_layer_fields`,
  which builds the provider fields `input_layernorms`, `output_layernorms` and
  `qk_layernorm_per_head` into the spec `GPTModelProvider.layer_spec` returns.
"""
