"""A tiny GPT for CPU runs and demos (about 360 thousand parameters)."""

from __future__ import annotations

from typing import Literal, Optional

from megatron_bridge.config.base import config_dataclass
from megatron_bridge.models.gpt_provider import GPTModelProvider


@config_dataclass
class TinyGPTModelProvider(GPTModelProvider):
    """3 layers, hidden 96, 4 heads, RoPE, vocabulary 256, 64-token sequences: a few hundredths of
    a second per iteration on a CPU. megatron-core local layers, no fused kernels, no dropout."""

    num_layers: int = 3
    """Transformer layers."""

    hidden_size: int = 96
    """Model width."""

    num_attention_heads: int = 4
    """Attention heads."""

    ffn_hidden_size: Optional[int] = 384
    """MLP width (4 x hidden)."""

    seq_length: int = 64
    """Tokens per sample."""

    vocab_size: Optional[int] = 256
    """Vocabulary size (a NullTokenizer of this size: the data are the token ids)."""

    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "rope"
    """Rotary position embedding."""

    hidden_dropout: float = 0.0
    """No dropout: runs are deterministic and losses comparable."""

    attention_dropout: float = 0.0
    """No attention dropout."""

    transformer_impl: Literal["local", "transformer_engine", "inference_optimized"] = "local"
    """megatron-core's own layers (TransformerEngine has no CPU build)."""

    use_cpu_initialization: bool = True
    """Create the weights on the CPU (works on GPUs too)."""
