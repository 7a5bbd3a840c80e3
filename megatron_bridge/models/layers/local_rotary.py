"""Rotary embeddings of their own for the sliding-window layers (Gemma 3's two RoPE bases).

megatron-core's `GPTModel` computes one rotary table (`rotary_base`, with its scaling) and hands
it to every layer. Gemma 3 rotates the full-attention layers with base 1e6 (and, in the larger
models, linear position scaling) but the sliding-window layers with base 10000 and no scaling.
`LocalRotarySelfAttention` is megatron-core's `SelfAttention` that, on a layer with a window
(`window_size` and `window_attn_skip_freq`, as the core attention decides it), swaps the table
it is given for one of `local_rotary_base` over the same positions; the full-attention layers
keep the model's table. The window layers share one `RotaryEmbedding`, whose tables are cached
per length, so a step computes each table once.

Every other rotary setting (rotary_percent, rotary_interleaved, packed sequences through
`cu_seqlens`) is the model's. Context parallelism (tables cut per rank) and the inference paths
that pass cos/sin instead of a table are not implemented: the provider refuses the first, the
layer raises on the second.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.utils import is_layer_window_attention


@functools.lru_cache(maxsize=8)
def shared_local_rotary(kv_channels: int, rotary_percent: float, interleaved: bool, base: int, cpu_init: bool,
                        cp_group: Any) -> Any:  # fmt: skip
    """The one `RotaryEmbedding` of the window layers of a model with these settings (keyed by
    the context-parallel group too: a model built after the groups are made again gets its own)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(
        kv_channels=kv_channels,
        rotary_percent=rotary_percent,
        rotary_interleaved=interleaved,
        rotary_base=base,
        use_cpu_initialization=cpu_init,
        cp_group=cp_group,
    )


def has_local_rotary(config: Any, layer_number: int) -> bool:
    """Whether layer `layer_number` (global, from 1) rotates with `local_rotary_base`."""
    return getattr(config, "local_rotary_base", None) is not None and is_layer_window_attention(
        config.window_size, config.window_attn_skip_freq, layer_number
    )


class LocalRotarySelfAttention(SelfAttention):
    """`SelfAttention` whose window layers use the `local_rotary_base` table (module docstring)."""

    def __init__(self, config: Any, submodules: Any, layer_number: int, *args: Any, **kwargs: Any):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.local_rotary: Optional[Any] = None
        if has_local_rotary(config, self.layer_number):
            rotary = shared_local_rotary(
                config.kv_channels,
                float(getattr(config, "rotary_percent", 1.0)),
                bool(config.rotary_interleaved),
                int(config.local_rotary_base),
                bool(config.use_cpu_initialization),
                self.pg_collection.cp,
            )
            # Not a submodule: it holds no state, and one instance serves every window layer.
            object.__setattr__(self, "local_rotary", rotary)

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                **kwargs):  # fmt: skip
        if self.local_rotary is not None:
            if rotary_pos_cos is not None or rotary_pos_sin is not None or rotary_pos_cos_sin is not None:
                raise NotImplementedError("a local rotary base with precomputed cos/sin (flash decoding) is not implemented")
            if rotary_pos_emb is not None:
                if isinstance(rotary_pos_emb, tuple):
                    raise NotImplementedError("a local rotary base with separate query and key tables is not implemented")
                packed = kwargs.get("packed_seq_params")
                rotary_pos_emb = self.local_rotary(
                    rotary_pos_emb.shape[0], packed_seq=packed is not None and packed.qkv_format == "thd"
                )
        return super().forward(hidden_states, attention_mask, key_value_states, inference_context, rotary_pos_emb,
                               rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, **kwargs)  # fmt: skip

    def extra_repr(self) -> str:
        return f"local rotary base {self.config.local_rotary_base}" if self.local_rotary is not None else ""
