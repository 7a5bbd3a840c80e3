"""Parameter counts and FLOPs from a GPT architecture, without building the model.

Matches what megatron-core's GPTModel allocates (local or TransformerEngine layers, which hold the
same parameters), so a 405B recipe can be sized on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a GPT model, counted from its shape."""

    total: int
    """All parameters."""

    active: int
    """Parameters used per token (differs from total for mixture-of-experts models)."""

    embedding: int
    """Input embedding (and learned positions) plus an untied output layer."""


def _moe_layers(m: Any) -> list[bool]:
    if not m.num_moe_experts:
        return [False] * m.num_layers
    freq = m.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(m.num_layers)]
    return [bool(x) for x in freq]


def _latent_attention(m: Any) -> int:
    """Multi-latent attention's weights: query projections (low-rank with a norm, or full), the
    key/value latent (with the keys' shared rope part) and its norm, the up projection to each
    head's keys and values, and the output projection."""
    h, heads = m.hidden_size, m.num_attention_heads
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    if m.q_lora_rank:
        query = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * q_head
    else:
        query = h * heads * q_head
    latent = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank
    key_value = m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim)
    return query + latent + key_value + heads * m.v_head_dim * h


def attention_widths(m: Any) -> tuple[int, int]:
    """(query/key, value) widths per head that the attention scores and sums run over."""
    if getattr(m, "multi_latent_attention", False):
        return m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    return kv, kv


def count_parameters(m: Any, vocab_size: int | None = None) -> ParameterCount:
    """Count the parameters of GPT provider `m` (finalized or not) for `vocab_size` (default:
    the provider's own, padded)."""
    h = m.hidden_size
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    kv = m.kv_channels or h // heads
    ffn = m.ffn_hidden_size or 4 * h
    gated = 2 if m.gated_linear_unit else 1
    bias = bool(m.add_bias_linear)
    qkv_bias = bias or bool(getattr(m, "add_qkv_bias", False))
    norm = h * (1 if m.normalization == "RMSNorm" else 2)
    vocab = m.padded_vocab_size(vocab_size)

    q_out = heads * kv
    kv_out = 2 * groups * kv
    attention = h * (q_out + kv_out) + (q_out + kv_out if qkv_bias else 0)
    attention += q_out * h + (h if bias else 0)
    if getattr(m, "multi_latent_attention", False):
        attention = _latent_attention(m) + (h if bias else 0)
    if getattr(m, "softmax_type", "vanilla") == "learnable":
        attention += heads  # one sink logit per head
    if m.qk_layernorm and not getattr(m, "multi_latent_attention", False):
        widths = 2 * kv if getattr(m, "qk_layernorm_per_head", True) else q_out + groups * kv
        attention += widths * (1 if m.normalization == "RMSNorm" else 2)
    norms_per_layer = 2 * (int(getattr(m, "input_layernorms", True)) + int(getattr(m, "output_layernorms", False)))

    def mlp(width: int) -> int:
        return h * width * gated + (width * gated if bias else 0) + width * h + (h if bias else 0)

    dense_mlp = mlp(ffn)
    moe_total = moe_active = 0
    if m.num_moe_experts:
        expert = mlp(m.moe_ffn_hidden_size or ffn)
        router = (h + (1 if bias else 0)) * m.num_moe_experts
        shared = 0
        if m.moe_shared_expert_intermediate_size:
            shared = mlp(m.moe_shared_expert_intermediate_size)
            if getattr(m, "moe_shared_expert_gate", False):
                shared += h
        moe_total = router + m.num_moe_experts * expert + shared
        moe_active = router + m.moe_router_topk * expert + shared

    total = active = 0
    layers = _moe_layers(m)
    for is_moe in layers:
        layer = norms_per_layer * norm + attention
        total += layer + (moe_total if is_moe else dense_mlp)
        active += layer + (moe_active if is_moe else dense_mlp)
    # multi-token prediction: per depth three norms, the 2h -> h projection and a layer like the last
    # decoder layer; the embedding and output layer are the model's
    for _ in range(_mtp_depths(m)):
        depth = 3 * norm + 2 * h * h + norms_per_layer * norm + attention
        total += depth + (moe_total if layers[-1] else dense_mlp)
        active += depth + (moe_active if layers[-1] else dense_mlp)
    final_norm = norm
    embedding = vocab * h
    if m.position_embedding_type == "learned_absolute":
        embedding += m.seq_length * h
    if not m.share_embeddings_and_output_weights:
        embedding += vocab * h
    total += final_norm + embedding
    active += final_norm + embedding
    return ParameterCount(total=total, active=active, embedding=embedding)


def _mtp_depths(m: Any) -> int:
    return getattr(m, "mtp_num_layers", None) or 0


def flops_per_token(m: Any, seq_length: int | None = None, vocab_size: int | None = None) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6 x active matmul parameters
    plus the attention score/context matmuls; each multi-token prediction depth runs its layer and
    the output layer once more."""
    count = count_parameters(m, vocab_size)
    seq = seq_length or m.seq_length
    non_embedding = count.active - count.embedding
    output_layer = (1 + _mtp_depths(m)) * m.padded_vocab_size(vocab_size) * m.hidden_size
    qk, v = attention_widths(m)
    layers = m.num_layers + _mtp_depths(m)
    attention = 2 * layers * seq * m.num_attention_heads * (qk + v)  # QK^T and AV, forward, per token
    return 3.0 * (2.0 * (non_embedding + output_layer) + attention)
