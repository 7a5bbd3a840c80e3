"""Test-only: a tiny megatron-core Llama checkpoint as a transformers `LlamaForCausalLM`.

Reads the base weights straight from the checkpoint files (whole tensors, layers stacked on the
first axis) and renames/splits them the Llama way. Only what the tests' tiny models use: RMSNorm,
SwiGLU, RoPE, no biases, untied output layer, no vocabulary padding.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from megatron_bridge.peft.hf_names import split_gate_up_rows, split_qkv_rows


def read_checkpoint(iteration_dir: str) -> dict[str, torch.Tensor]:
    reader = dcp.FileSystemReader(iteration_dir)
    meta = reader.read_metadata().state_dict_metadata
    keys = [
        k for k, v in meta.items() if not k.startswith("optimizer.") and hasattr(v, "size") and "_extra_state" not in k
    ]
    tensors = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def llama_from_megatron(iteration_dir: str, model_cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    m = model_cfg
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    head_dim = m.kv_channels or m.hidden_size // heads
    config = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim,
        rms_norm_eps=m.layernorm_epsilon, rope_theta=float(m.rotary_base), max_position_embeddings=m.seq_length,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
    )  # fmt: skip
    t = read_checkpoint(iteration_dir)
    sd = {
        "model.embed_tokens.weight": t["embedding.word_embeddings.weight"],
        "model.norm.weight": t["decoder.final_layernorm.weight"],
        "lm_head.weight": t["output_layer.weight"],
    }
    for i in range(m.num_layers):
        layer = f"model.layers.{i}."
        q, k, v = split_qkv_rows(t["decoder.layers.self_attention.linear_qkv.weight"][i], heads, groups, head_dim)
        gate, up = split_gate_up_rows(t["decoder.layers.mlp.linear_fc1.weight"][i])
        sd.update({
            layer + "input_layernorm.weight": t["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i],
            layer + "self_attn.q_proj.weight": q, layer + "self_attn.k_proj.weight": k, layer + "self_attn.v_proj.weight": v,
            layer + "self_attn.o_proj.weight": t["decoder.layers.self_attention.linear_proj.weight"][i],
            layer + "post_attention_layernorm.weight": t["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i],
            layer + "mlp.gate_proj.weight": gate, layer + "mlp.up_proj.weight": up,
            layer + "mlp.down_proj.weight": t["decoder.layers.mlp.linear_fc2.weight"][i],
        })  # fmt: skip
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model.eval()
