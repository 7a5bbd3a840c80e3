"""Attention masks for the local core attentions: sliding windows, packed samples, and
megatron-core's `DotProductAttention` with a window that keeps the mask it is given.

Masks here are boolean with megatron-core's sense, **True where attention is blocked**, shaped to
broadcast against scores [b, heads, sq, sk]. Windows follow megatron-core and TransformerEngine:
`window_size=(left, right)` lets query i see keys i - left ... i + right (inclusive, aligned at
the bottom right when sq != sk), and -1 leaves that side unbounded.

megatron-core's local softmax replaces the mask it is given by the window mask when a layer has a
window, so samples packed into one sequence (a block-diagonal mask) would see each other there.
`WindowedDotProductAttention` gives the softmax both, composed.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)
"""Mask types whose keys after the query are blocked."""


@functools.lru_cache(maxsize=8)
def blocked_outside_window(sq: int, sk: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """[sq, sk] True where key j lies outside query i's window (see the module docstring).
    Cached: every layer of a step asks for the same one."""
    i = torch.arange(sq, device=device).view(-1, 1) + (sk - sq)
    j = torch.arange(sk, device=device).view(1, -1)
    blocked = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        blocked |= j < i - left
    if right >= 0:
        blocked |= j > i + right
    return blocked


def window_for(window_size: Optional[tuple[int, int]], mask_type: AttnMaskType) -> Optional[tuple[int, int]]:
    """The (left, right) window a layer applies: a causal layer sees no key after the query (as
    TransformerEngine sets it), None without a window."""
    causal = mask_type in CAUSAL_TYPES
    if window_size is None:
        return (-1, 0) if causal else None
    left, right = int(window_size[0]), int(window_size[1])
    return (left, 0) if causal else (left, right)


def restricts(window: Optional[tuple[int, int]], sq: int, sk: int) -> bool:
    """True if `window` blocks a key that plain causal attention (sq == sk) would let through."""
    if window is None:
        return False
    left, right = window
    return sq != sk or right != 0 or 0 <= left < sk - 1


def segment_blocked(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[1, 1, t, t] True between tokens of different samples of one packed sequence;
    `cu_seqlens` holds the sample boundaries (0, ..., t)."""
    starts = torch.zeros(total, dtype=torch.int32, device=cu_seqlens.device)
    inner = cu_seqlens[1:-1].long()
    starts[inner[inner < total]] = 1
    segment = torch.cumsum(starts, dim=0)
    return (segment[:, None] != segment[None, :]).view(1, 1, total, total)


class WindowedDotProductAttention(DotProductAttention):
    """megatron-core's local `DotProductAttention` for a layer with a sliding window: the window
    is composed with the mask it is given (packed samples stay apart) instead of replacing it.
    Everything else is megatron-core's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The softmax would swap any mask for its window mask; here the window joins the mask.
        own = self.scale_mask_softmax.window_size  # None on the layers window_attn_skip_freq skips
        self.window = window_for(own, self.attn_mask_type) if own is not None else None
        self.scale_mask_softmax.window_size = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        window = self.window
        if window is not None:
            blocked = blocked_outside_window(query.shape[0], key.shape[0], *window, query.device)
            attention_mask = blocked if attention_mask is None else attention_mask.bool() | blocked
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
