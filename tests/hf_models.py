"""Tiny random Hugging Face models of every family we convert, built offline with transformers'
own config classes and `save_pretrained`; and our megatron-core model's logits for them."""

from __future__ import annotations

import os
from typing import Optional

import torch

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.125,  # large enough that a wrong mapping moves the logits far beyond 1e-4
    rms_norm_eps=1e-5,
)
MOE = dict(intermediate_size=48, num_experts_per_tok=2)
DEEPSEEK = dict(
    num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, kv_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, first_k_dense_replace=1, routed_scaling_factor=2.5,
)  # fmt: skip
"""DeepSeek-V3's shape, tiny: the first layer dense, the second MoE (8 experts and a shared one)."""
# the ramp between beta_fast and beta_slow falls inside the 8 frequencies, off whole dimensions (truncate matters)
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 64, "truncate": False}  # fmt: skip


def family_configs() -> dict:
    """name -> a transformers config of a tiny model of that family."""
    from transformers import (
        DeepseekV3Config,
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}  # fmt: skip
    llama3_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    # Gemma: a 4-token window (sequences are 16), one window and one global layer, a softmax scale
    # other than head_dim ** -0.5; Gemma 3 with its two RoPE bases and linear scaling on the
    # global layer, Gemma 2 with caps small enough to bind on these logits and scores.
    gemma = dict(**{**COMMON, "rms_norm_eps": 1e-6}, head_dim=32, sliding_window=4, query_pre_attn_scalar=24)
    gemma3_rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
    return {
        "gemma3": Gemma3TextConfig(**gemma, layer_types=["sliding_attention", "full_attention"], rope_parameters=gemma3_rope),
        "gemma2": Gemma2Config(**gemma, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
        "llama": LlamaConfig(**{**COMMON, "max_position_embeddings": 16384}, rope_parameters=llama3_rope),
        "llama_tied": LlamaConfig(**COMMON, tie_word_embeddings=True),
        "mistral": MistralConfig(**COMMON, sliding_window=8),
        "mixtral": MixtralConfig(**{**COMMON, **MOE}, num_local_experts=4),
        "qwen2": Qwen2Config(**{**COMMON, "vocab_size": 250}),
        "qwen3": Qwen3Config(**COMMON, head_dim=32),
        "qwen3_moe": Qwen3MoeConfig(**{**COMMON, **MOE}, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True),
        "olmo2": Olmo2Config(**COMMON),
        "phi3": Phi3Config(**COMMON, sliding_window=8, pad_token_id=0, eos_token_id=1),
        # low-rank queries, group-limited routing (4 of 8 experts from 2 of 4 groups), YaRN, rotary rows
        # stored in halves (rope_interleave=False: permuted on the way in and out)
        "deepseek_v3": DeepseekV3Config(**{**COMMON, **DEEPSEEK}, q_lora_rank=24, num_experts_per_tok=4, n_group=4,
                                        topk_group=2, rope_parameters=yarn, rope_interleave=False),
        # Moonlight's shape: a full query projection, no groups, plain rope
        "deepseek_v3_plain": DeepseekV3Config(**{**COMMON, **DEEPSEEK}, q_lora_rank=None, num_experts_per_tok=2,
                                              n_group=1, topk_group=1),
        # Phi-4-mini's shape: rotary embeddings over part of each head, tied embeddings
        # sinks, a 4-token window on every other layer, YaRN, stacked experts whose clamps bite (save_tiny)
        "gpt_oss": GptOssConfig(**{**COMMON, **MOE}, head_dim=16, num_local_experts=4, sliding_window=4,
                                rope_parameters=GPT_OSS_YARN),
        "phi3_partial": Phi3Config(**{**COMMON, "vocab_size": 250}, tie_word_embeddings=True, partial_rotary_factor=0.5,
                                     pad_token_id=0, eos_token_id=1),
    }


def save_tiny(name: str, directory: str, seed: int = 0, max_shard_size: Optional[str] = None, config=None) -> str:
    """Build the tiny `name` model with random weights (norms and biases randomized too, so each
    mapping matters) and `save_pretrained` it to `directory`, in fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config if config is not None else family_configs()[name]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif pname.endswith("sinks"):  # attention sinks large enough to take much of each softmax row
                param.copy_(torch.randn_like(param))
            elif pname.endswith("experts.gate_up_proj"):  # GPT-OSS: gate and up values beyond the clamp at 7
                param.mul_(8.0)
            elif pname.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
        for bname, buffer in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # DeepSeek's expert bias: it changes the routing
                buffer.copy_(0.1 * torch.randn_like(buffer))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def hf_reference_model(directory: str):
    """transformers' fp32 model of `directory` in eval mode, the reference our logits are compared
    with. Soft-capped attention scores (Gemma 2) exist only in transformers' eager attention, and
    older transformers (5.17 among them) loads Gemma 2 with SDPA by default, which drops the cap:
    such models are loaded with eager attention explicitly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    softcapped = getattr(AutoConfig.from_pretrained(directory), "attn_logit_softcapping", None) is not None
    extra = {"attn_implementation": "eager"} if softcapped else {}
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **extra).eval()


def hf_logits(directory: str, tokens: torch.Tensor) -> torch.Tensor:
    model = hf_reference_model(directory)
    with torch.no_grad():
        return model(tokens).logits


def megatron_logits(source: str, tokens: torch.Tensor, tp: int = 1, pp: int = 1, ep: int = 1,
                    backend: str = "auto") -> Optional[torch.Tensor]:
    """Logits of our megatron-core model loaded from `source` (a Hugging Face directory, or a
    checkpoint of ours) under the current launch (TP x PP x EP ranks, `backend`: see
    `model_parallel`); the full vocabulary (padding rows included) on the last pipeline stage, as
    a CPU tensor, None elsewhere. `tokens` may be on any device: they go where the model is."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_bridge.models import GPTModelProvider
    from megatron_bridge.models.hf.convert import checkpoint_provider
    from megatron_bridge.models.hf.files import is_hf_directory
    from megatron_bridge.models.hf.load import load_hf_weights
    from megatron_bridge.models.hf.runtime import build_chunks, load_checkpoint_weights, model_parallel, prepare
    from megatron_bridge.runtime.checkpointing.layout import resolve

    if is_hf_directory(source):
        provider = GPTModelProvider.from_hf(source)
        load = lambda chunks: load_hf_weights(chunks, source)  # noqa: E731
    else:
        directory = resolve(source)[0]
        provider = checkpoint_provider(directory)
        load = lambda chunks: load_checkpoint_weights(chunks, directory)  # noqa: E731
    batch, seq = tokens.shape
    with model_parallel(tp=tp, pp=pp, ep=ep, etp=provider.expert_tensor_parallel(tp), backend=backend) as device:
        model = prepare(provider, device, parallel_output=False, seq_length=seq, moe_token_dispatcher_type="allgather")
        chunks = build_chunks(model, device)
        load(chunks)
        on_model = next(chunks[0].parameters()).device
        data = iter([{"tokens": tokens.to(on_model), "position_ids": torch.arange(seq, device=on_model).expand(batch, seq)}])

        def step(data_iterator, module):
            item = next(data_iterator)
            output = module(item["tokens"], item["position_ids"], None)
            return output, lambda out, non_loss_data=False: out.detach().cpu().clone()

        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=data, model=chunks, num_microbatches=1, seq_length=seq,
            micro_batch_size=batch, forward_only=True, collect_non_loss_data=True,
        )  # fmt: skip
        last = parallel_state.is_pipeline_last_stage()
    return out[0].float().cpu() if last else None


def random_tokens(vocab: int, batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def in_subprocess_env() -> dict:
    """The environment of a subprocess of these tests (see `factories.source_tree_env`)."""
    from factories import source_tree_env

    return source_tree_env()
