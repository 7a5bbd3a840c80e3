"""Phi-3 (Microsoft): Phi-3 mini, and its Hugging Face architecture (`Phi3ForCausalLM`, also used
by Phi-3.5 and Phi-4).

The Llama architecture; the Hugging Face files fuse the query/key/value projection (`qkv_proj`:
all query heads, then all key heads, then all value heads) and the gate/up projection
(`gate_up_proj`: all gate rows, then all up rows), which are split on import and fused again on
export. A `sliding_window` applies to every layer. Long-context rope scaling (`longrope`, the
128k-context models) is not implemented and is refused; a partial rotary embedding
(`partial_rotary_factor`, Phi-4-mini) is `rotary_percent`.
"""

from __future__ import annotations

from typing import Optional, Tuple

from megatron_bridge.config.base import config_dataclass
from megatron_bridge.models.hf.family import HFFamily, causal_window, read_rope_theta, rope_scaling_of
from megatron_bridge.models.hf.mapping import Copy, FusedGated, FusedQKV, Mapped
from megatron_bridge.models.hf.registry import register
from megatron_bridge.models.llama import LlamaModelProvider


@config_dataclass
class Phi3ModelProvider(LlamaModelProvider):
    """Phi-3: the Llama architecture with a 32064-token vocabulary and RoPE base 10000."""

    vocab_size: Optional[int] = 32064
    """Vocabulary size (the embedding rows)."""

    rotary_base: int = 10000
    """RoPE base period."""

    seq_length: int = 4096
    """Context length."""


@config_dataclass
class Phi3ModelProviderMini(Phi3ModelProvider):
    """Phi-3 mini with a 4k context (3.82B parameters): multi-head attention, a sliding window of
    2047 tokens."""

    num_layers: int = 32
    """Transformer layers."""

    hidden_size: int = 3072
    """Model width."""

    num_attention_heads: int = 32
    """Attention heads."""

    num_query_groups: Optional[int] = 32
    """Key/value heads (32: plain multi-head attention)."""

    ffn_hidden_size: Optional[int] = 8192
    """MLP width."""

    window_size: Optional[Tuple[int, int]] = (2046, 0)
    """Sliding attention window: each token sees itself and the 2046 tokens before it."""


# ---------------------------------------------------------------------- Hugging Face
@register
class Phi3Family(HFFamily):
    """`Phi3ForCausalLM`: fused `self_attn.qkv_proj` and `mlp.gate_up_proj`."""

    architecture = "Phi3ForCausalLM"
    model_type = "phi3"
    provider = Phi3ModelProvider
    adapter_modules = {
        "self_attention.linear_qkv": ("self_attn.qkv_proj",),
        "self_attention.linear_proj": ("self_attn.o_proj",),
        "mlp.linear_fc1": ("mlp.gate_up_proj",),
        "mlp.linear_fc2": ("mlp.down_proj",),
    }

    def read_decoder(self, read):
        kw = super().read_decoder(read)
        resid = read.float("resid_pdrop", default=0.0)
        embedding = read.float("embd_pdrop", default=0.0)
        if embedding != resid:
            read.refuse("embd_pdrop", f"{embedding} differs from resid_pdrop={resid} (one hidden_dropout is applied to "
                        "both here)", "convert with embd_pdrop equal to resid_pdrop")  # fmt: skip
        read.used("original_max_position_embeddings")  # read by longrope only
        return {**kw, "hidden_dropout": resid}

    def read_rotary_fraction(self, read):
        params = read.hf.get("rope_parameters") or {}
        fraction = params.get("partial_rotary_factor", read.hf.get("partial_rotary_factor", 1.0))
        read.used("partial_rotary_factor")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            read.refuse("partial_rotary_factor", f"{fraction!r} is not a fraction in (0, 1]", "")
            return {}
        return {"rotary_percent": float(fraction)}

    def read_rope(self, read):
        out = read_rope_theta(read)
        _, field, kind = rope_scaling_of(read)
        if kind != "default":
            read.refuse(f"{field}.rope_type", f"{kind!r}: Phi-3's long-context rope scaling is not implemented "
                        "(default rope is)", "convert a model without rope scaling (the 4k-context ones)")  # fmt: skip
        return out

    def read_window(self, read):
        return self.read_sliding_window(read)

    def settings(self):
        return {
            **super().settings(),
            "rotary_percent": lambda fraction: 0 < fraction <= 1,
            "rope_scaling": False,
            "seq_len_interpolation_factor": None,
            "window_size": causal_window,
        }

    def hf_config(self, p, dtype):
        cfg = super().hf_config(p, dtype)
        cfg.update(
            sliding_window=p.window_size[0] + 1 if p.window_size is not None else None,
            partial_rotary_factor=p.rotary_percent,
            original_max_position_embeddings=p.seq_length,
            resid_pdrop=p.hidden_dropout,
            embd_pdrop=p.hidden_dropout,
        )
        return cfg

    def attention_tensors(self, a, L):
        attn = f"model.layers.{L}.self_attn"
        qkv = FusedQKV(f"{attn}.qkv_proj.weight", a.heads, a.groups, a.head_dim)
        return {
            "self_attention.linear_qkv.weight": Mapped((self.qkv_rows(a), a.hidden), qkv),
            "self_attention.linear_proj.weight": Mapped(
                (a.hidden, a.heads * a.head_dim), Copy(f"{attn}.o_proj.weight")
            ),
        }

    def mlp_tensors(self, a, L):
        p = f"model.layers.{L}.mlp"
        return {
            "mlp.linear_fc1.weight": Mapped((2 * a.ffn, a.hidden), FusedGated(f"{p}.gate_up_proj.weight")),
            "mlp.linear_fc2.weight": Mapped((a.hidden, a.ffn), Copy(f"{p}.down_proj.weight")),
        }
