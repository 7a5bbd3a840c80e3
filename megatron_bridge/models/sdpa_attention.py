"""`SDPAttention`: the core attention of megatron-core's local layers on
`torch.nn.functional.scaled_dot_product_attention`.

It has the interface of megatron-core's `DotProductAttention` (the `core_attention` submodule of
a self-attention layer): query [sq, b, heads, d], key and value [sk, b, groups, d] for this
tensor-parallel rank, output [sq, b, heads * d]; with packed sequences in megatron-core's `thd`
format, [t, heads, d] in and [t, heads * d] out. It computes what `DotProductAttention` computes
(see `attention_masks` for the mask semantics) without keeping a score matrix: on GPUs torch
runs a flash or memory-efficient kernel, on CPUs a fused kernel or its math path.

* Plain causal attention goes to the kernels as `is_causal` (no mask tensor: flash-eligible).
* Grouped-query attention passes `enable_gqa` where the kernel that will run takes it (torch
  >= 2.5: flash and math); with a mask on a GPU the memory-efficient kernel runs, which needs
  the key/value heads repeated.
* A mask (packed samples, a sliding window, or one from the batch) goes in as a boolean mask.
* Dropout runs in training only, on the model-parallel RNG stream as megatron-core's.
* Attention sinks (`softmax_type` 'learnable': a learned logit per head in every softmax row,
  dropped after the softmax; 'off-by-one': that logit is 0) are one more key that every query
  sees, whose value is zero. SDPA adds no constant to the scores, so the sink is a dot product: the
  head dimension grows by 8 (a multiple of 8 for the fused kernels), the queries' first extra
  dimension holding sink / scale, the sink key's holding 1, every other key's 0, so the ordinary
  scores are unchanged and the sink's is its logit (exactly where the scale is a power of two, as
  for 16 and 64 dimensions per head; else up to the rounding of sink / scale in the activations'
  dtype). The learned logits are the `softmax_offset` parameter, split over tensor-parallel ranks
  by head, as in megatron-core's `DotProductAttention`: checkpoints are the same for both.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_bridge.models.attention_masks import (
    CAUSAL_TYPES,
    blocked_outside_window,
    restricts,
    segment_blocked,
    window_for,
)

SINKS = ("vanilla", "off-by-one", "learnable")
"""The softmax types served: none, a zero logit, or a learned logit per head in every row."""

SINK_DIMS = 8
"""Dimensions added to each head to carry the sink logit (8 keeps fused kernels eligible)."""

_ENABLE_GQA = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
"""`scaled_dot_product_attention(enable_gqa=...)` exists (torch 2.5)."""


class SDPAttention(MegatronModule):
    """Core attention through PyTorch's scaled_dot_product_attention (see the module docstring).
    Parameters (the learned sinks only) and checkpoints as megatron-core's DotProductAttention."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not split sequences over context-parallel ranks")
        if config.softmax_type not in SINKS:
            raise ValueError(f"SDPAttention has no softmax_type={config.softmax_type!r}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp
        heads = config.num_attention_heads // self.tp_group.size()
        # as megatron-core's DotProductAttention: the parameter, its device, dtype and initialization
        if config.softmax_type == "vanilla":
            self.softmax_offset = None
        elif config.softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(heads, device=torch.cuda.current_device(), dtype=config.params_dtype)
        else:
            offset = torch.empty(heads, device=torch.cuda.current_device(), dtype=config.params_dtype)
            self.register_parameter("softmax_offset", torch.nn.Parameter(offset))
            if config.perform_initialization:
                self.softmax_offset = config.init_method(self.softmax_offset)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # apply_query_key_layer_scaling divides the scores by the layer number and the softmax
        # multiplies them back: only fp16 range changes, which these kernels do not need.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        own = config.window_size if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number) else None
        self.window_size = own
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """megatron-core DotProductAttention's: the learned offsets split over tensor-parallel ranks."""
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention.sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention takes no attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        thd = packed_seq_params is not None
        if thd:
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError(f"SDPAttention takes packed sequences in 'thd' format, not {packed_seq_params.qkv_format!r}")
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        sq, sk = query.shape[0], key.shape[0]
        # [s, b, h, d] -> [b, h, s, d] as views (last dimension still contiguous, as the kernels need)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))

        window = window_for(self.window_size, mask_type)
        blocked = attention_mask.bool() if attention_mask is not None else None
        if thd:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            segments = segment_blocked(cu, sq)
            blocked = segments if blocked is None else blocked | segments
        is_causal = False
        if window is not None and blocked is None and not restricts(window, sq, sk):
            is_causal = True  # plain causal: no mask tensor, so flash kernels qualify
        elif window is not None:
            outside = blocked_outside_window(sq, sk, *window, q.device)
            blocked = outside if blocked is None else blocked | outside

        if self.softmax_offset is not None:
            if is_causal:  # the sink key comes first: query i sees it and keys 0 ... i
                blocked, is_causal = blocked_outside_window(sq, sk, -1, 0, q.device), False
            q, k, v, blocked = with_sink_key(q, k, v, blocked, self.softmax_offset, self.softmax_scale)

        extra = {}
        heads, groups = q.shape[1], k.shape[1]
        if heads != groups:
            if _ENABLE_GQA and (blocked is None or not q.is_cuda):
                extra["enable_gqa"] = True
            else:
                k = k.repeat_interleave(heads // groups, dim=1)
                v = v.repeat_interleave(heads // groups, dim=1)
        dropout_p = self.dropout_p if self.training else 0.0
        attend = None if blocked is None else ~blocked

        def attention() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attend, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale, **extra
            )

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = attention()
        else:
            out = attention()
        if self.softmax_offset is not None:
            out = out[..., : out.shape[-1] - SINK_DIMS]
        # [b, h, sq, d] -> [sq, b, h * d]
        out = out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], -1)
        return out.squeeze(1) if thd else out


def with_sink_key(q, k, v, blocked, sink, scale):
    """(q, k, v, blocked) with the sink key in front of the keys ([b, heads or groups, s, d]
    tensors; `blocked` True where a query may not see a key, or None): see the module docstring.
    Every query sees the sink key."""
    b, heads, sq, d = q.shape
    groups, sk = k.shape[1], k.shape[2]
    logits = (sink.float() / scale).to(q.dtype).view(1, heads, 1, 1).expand(b, heads, sq, 1)
    q = torch.cat([q, logits, q.new_zeros(b, heads, sq, SINK_DIMS - 1)], dim=-1)
    key = k.new_zeros(b, groups, 1, d + SINK_DIMS)
    key[..., d] = 1
    k = torch.cat([key, torch.cat([k, k.new_zeros(b, groups, sk, SINK_DIMS)], dim=-1)], dim=2)
    value = v.new_zeros(b, groups, 1, d + SINK_DIMS)
    v = torch.cat([value, torch.cat([v, v.new_zeros(b, groups, sk, SINK_DIMS)], dim=-1)], dim=2)
    if blocked is not None:
        blocked = torch.cat([blocked.new_zeros(*blocked.shape[:-1], 1), blocked], dim=-1)
    return q, k, v, blocked

