"""The Llama family (Meta): Llama 2 7B, Llama 3 8B / 70B, Llama 3.1 405B, and its Hugging Face
architecture (`LlamaForCausalLM`).

Architectures are the published ones (model cards and configuration files), as plain defaults.
"""

from __future__ import annotations

from typing import Callable, Literal, Optional

import torch.nn.functional as F

from megatron_bridge.config.base import config_dataclass
from megatron_bridge.models.gpt_provider import GPTModelProvider
from megatron_bridge.models.hf.family import HFFamily
from megatron_bridge.models.hf.registry import register


@config_dataclass
class LlamaModelProvider(GPTModelProvider):
    """The Llama architecture: pre-RMSNorm, SwiGLU MLP, rotary positions, no linear biases, untied
    output layer, no dropout. Sizes come from the subclasses; Mistral and Qwen build on it."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """RMSNorm before attention and MLP."""

    activation_func: Callable = F.silu
    """SiLU, gated (SwiGLU) through gated_linear_unit."""

    gated_linear_unit: bool = True
    """The MLP's first projection is gated (SwiGLU)."""

    add_bias_linear: bool = False
    """No biases in linear layers."""

    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "rope"
    """Rotary position embedding."""

    share_embeddings_and_output_weights: bool = False
    """Separate input embedding and output layer."""

    hidden_dropout: float = 0.0
    """No dropout (as in pretraining)."""

    attention_dropout: float = 0.0
    """No attention dropout."""

    layernorm_epsilon: float = 1e-5
    """RMSNorm epsilon."""

    init_method_std: float = 0.02
    """Std of the normal weight initialization."""

    bias_activation_fusion: bool = True
    """Fuse the SwiGLU activation (a TorchScript kernel, available everywhere)."""

    bias_dropout_fusion: bool = True
    """Fuse bias, dropout and residual add (a TorchScript kernel, available everywhere)."""


@config_dataclass
class Llama2ModelProvider(LlamaModelProvider):
    """Llama 2: 4096-token context, RoPE base 10000, 32000-token SentencePiece vocabulary."""

    rotary_base: int = 10000
    """RoPE base period."""

    seq_length: int = 4096
    """Context length."""

    vocab_size: Optional[int] = 32000
    """Vocabulary size."""


@config_dataclass
class Llama2ModelProvider7B(Llama2ModelProvider):
    """Llama 2 7B (6.74B parameters): multi-head attention."""

    num_layers: int = 32
    """Transformer layers."""

    hidden_size: int = 4096
    """Model width."""

    num_attention_heads: int = 32
    """Attention heads."""

    num_query_groups: Optional[int] = 32
    """Key/value heads (32: plain multi-head attention)."""

    ffn_hidden_size: Optional[int] = 11008
    """MLP width."""


@config_dataclass
class Llama3ModelProvider(LlamaModelProvider):
    """Llama 3: 8192-token context, RoPE base 500000, 128256-token vocabulary, grouped-query
    attention with 8 key/value heads."""

    rotary_base: int = 500000
    """RoPE base period."""

    seq_length: int = 8192
    """Context length."""

    vocab_size: Optional[int] = 128256
    """Vocabulary size."""

    num_query_groups: Optional[int] = 8
    """Key/value heads."""


@config_dataclass
class Llama3ModelProvider8B(Llama3ModelProvider):
    """Llama 3 8B (8.03B parameters)."""

    num_layers: int = 32
    """Transformer layers."""

    hidden_size: int = 4096
    """Model width."""

    num_attention_heads: int = 32
    """Attention heads."""

    ffn_hidden_size: Optional[int] = 14336
    """MLP width."""


@config_dataclass
class Llama3ModelProvider70B(Llama3ModelProvider):
    """Llama 3 70B (70.6B parameters)."""

    num_layers: int = 80
    """Transformer layers."""

    hidden_size: int = 8192
    """Model width."""

    num_attention_heads: int = 64
    """Attention heads."""

    ffn_hidden_size: Optional[int] = 28672
    """MLP width."""


@config_dataclass
class Llama31ModelProvider(Llama3ModelProvider):
    """Llama 3.1: Llama 3 with RoPE frequency scaling (factor 8 over the original 8192-token
    context), for a 131072-token context."""

    rope_scaling: bool = True
    """Llama 3.1 RoPE frequency scaling."""

    rope_scaling_factor: float = 8.0
    """RoPE scaling factor."""

    seq_length: int = 131072
    """Context length."""


@config_dataclass
class Llama31ModelProvider405B(Llama31ModelProvider):
    """Llama 3.1 405B (405.9B parameters)."""

    num_layers: int = 126
    """Transformer layers."""

    hidden_size: int = 16384
    """Model width."""

    num_attention_heads: int = 128
    """Attention heads."""

    ffn_hidden_size: Optional[int] = 53248
    """MLP width."""


# ---------------------------------------------------------------------- Hugging Face
@register
class LlamaFamily(HFFamily):
    """`LlamaForCausalLM` (Llama 2, 3, 3.1 and 3.2): the layout `HFFamily` describes."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    provider = LlamaModelProvider

    def hf_config(self, p, dtype):
        return {**super().hf_config(p, dtype), "attention_bias": False}
