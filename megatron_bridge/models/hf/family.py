"""`HFFamily`: one Hugging Face architecture, both ways.

A family says how a `config.json` becomes provider fields (and which settings it refuses, naming
the field), which provider settings it can write back (`settings`) and the config.json it writes,
and which Hugging Face tensors make each megatron-core parameter (`layer_tensors`, ...), as
`Mapped` entries (whole shape, `Rule`). The defaults here are the decoder layout most Hugging Face
causal LMs share (the Llama one: `model.layers.N.self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm`, RMSNorm, SwiGLU, RoPE);
a family overrides only what differs. Family modules register their subclass with
`registry.register`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Optional

from megatron_bridge.config.errors import show
from megatron_bridge.models.hf.mapping import QKV, Architecture, Copy, Gated, Mapped, Vocab

if TYPE_CHECKING:
    from megatron_bridge.models.hf.config import ConfigReader

LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""Llama 3.1 rope scaling: megatron-core implements it with these constants."""


def is_silu(func: Any) -> bool:
    return getattr(func, "__name__", "") == "silu"


def no_experts(value: Any) -> bool:
    return not value


def has_experts(value: Any) -> bool:
    return bool(value)


def causal_window(value: Any) -> bool:
    """No window, or a window over earlier tokens only (what a `sliding_window` field means)."""
    return value is None or value[1] == 0


def read_rope_theta(read: "ConfigReader") -> dict[str, Any]:
    """`rotary_base` from `rope_theta` (transformers 4) or `rope_parameters.rope_theta` (5)."""
    hf = read.hf
    params = hf.get("rope_parameters") or {}
    read.used("rope_parameters")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    read.used("rope_theta")
    if not isinstance(theta, (int, float)) or float(theta) != int(theta) or theta <= 0:
        read.refuse("rope_theta", f"{show(theta)} is not a positive whole number", "")
        return {}
    return {"rotary_base": int(theta)}


def rope_scaling_of(read: "ConfigReader") -> tuple[dict, str, str]:
    """(scaling settings, the field holding them, rope type) of a config.json: `rope_scaling`
    (transformers 4) or `rope_parameters` (5); type 'default' without scaling."""
    hf = read.hf
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    read.used("rope_scaling")
    field = "rope_scaling"
    if not scaling and params.get("rope_type", "default") != "default":
        scaling, field = params, "rope_parameters"
    if not scaling:
        return {}, field, "default"
    return scaling, field, scaling.get("rope_type", scaling.get("type", "default"))


def read_renormalized_topk(read: "ConfigReader", field: str = "num_experts_per_tok", why: str = "") -> Optional[int]:
    """`num_experts_per_tok` of a router whose top-k weights sum to 1 (softmax over the chosen
    experts, megatron-core's `moe_router_pre_softmax=False`). One expert is refused, naming
    `field`: such a router weighs it by 1, megatron-core's top-1 routing by its probability."""
    topk = read.int("num_experts_per_tok")
    if topk == 1:
        read.refuse(field, f"{why or 1} cannot be converted (transformers weighs the one expert chosen by 1, "
                    "megatron-core's top-1 routing by its softmax probability)",
                    "convert a model choosing more than one expert")  # fmt: skip
    return topk


def scalar(value: Any) -> float:
    """A per-layer list's first value, or the value."""
    return float(value[0] if isinstance(value, (list, tuple)) else value)


def vocab_multiple(vocab: int) -> int:
    """The largest power of two up to 128 dividing `vocab`: no padding rows at TP=1, so the
    logits (and the loss) are those of the Hugging Face model."""
    multiple = 128
    while vocab % multiple:
        multiple //= 2
    return multiple


class HFFamily:
    """A Hugging Face causal-LM architecture and the provider that computes it."""

    architecture: ClassVar[str] = ""
    """`architectures[0]` of its config.json (`LlamaForCausalLM`)."""

    model_type: ClassVar[str] = ""
    """`model_type` of its config.json (`llama`)."""

    provider: ClassVar[type]
    """The provider class `from_hf` returns."""

    nullable_fields: ClassVar[tuple[str, ...]] = ("window_size", "moe_input_jitter_eps")
    """Provider fields set explicitly even when None (others are left to the provider's default)."""

    adapter_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attention.linear_proj": ("self_attn.o_proj",),
        "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.linear_fc2": ("mlp.down_proj",),
    }
    """Per layer: megatron-core linear module -> the Hugging Face modules holding its rows, in row
    order (what LoRA adapters are exported onto). One module for `linear_qkv` holds all query,
    then key, then value rows; one for `linear_fc1` all gate, then all up rows."""

    # ------------------------------------------------------------------ config.json -> provider
    def provider_fields(self, read: "ConfigReader") -> dict[str, Any]:
        """Provider fields from config.json; a setting the provider cannot reproduce is refused
        through `read` (naming the field)."""
        kw = self.read_decoder(read)
        kw.update(self.read_attention(read))
        kw.update(self.read_window(read))
        self.read_layer_types(read)
        kw.update(self.read_mlp(read, kw))
        return kw

    def build_provider(self, fields: dict[str, Any]) -> Any:
        return self.provider(**{k: v for k, v in fields.items() if v is not None or k in self.nullable_fields})

    def read_decoder(self, read: "ConfigReader") -> dict[str, Any]:
        """Sizes, norms, rotary embeddings and the gated MLP."""
        heads = read.int("num_attention_heads")
        hidden = read.int("hidden_size")
        vocab = read.int("vocab_size")
        groups = read.int("num_key_value_heads", default=heads)
        head_dim = read.int("head_dim", default=hidden // heads if hidden and heads else None)
        kw: dict[str, Any] = dict(
            num_layers=read.int("num_hidden_layers"),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=head_dim,
            ffn_hidden_size=read.int("intermediate_size"),
            vocab_size=vocab,
            make_vocab_size_divisible_by=vocab_multiple(vocab) if vocab else 128,
            seq_length=read.int("max_position_embeddings", default=4096),
            layernorm_epsilon=read.float("rms_norm_eps", default=1e-6),
            share_embeddings_and_output_weights=read.bool("tie_word_embeddings", default=False),
            attention_dropout=read.float("attention_dropout", default=0.0),
            init_method_std=read.float("initializer_range", default=0.02),
            position_embedding_type="rope",
        )
        kw.update(self.read_activation(read))
        read.expect("mlp_bias", False, "the providers have no MLP biases")
        kw.update(self.read_rotary_fraction(read))
        self.read_quantization(read)
        kw.update(self.read_rope(read))
        return kw

    def read_activation(self, read: "ConfigReader") -> dict[str, Any]:
        """The gated MLP's activation (`activation_func`)."""
        import torch.nn.functional as F

        read.expect("hidden_act", "silu", "only SiLU-gated MLPs are converted")
        return {"activation_func": F.silu}

    def read_quantization(self, read: "ConfigReader") -> None:
        """Quantized weights (`quantization_config`) are refused: the model computes in floating
        point."""
        if "quantization_config" in read.hf:
            read.refuse("quantization_config", "quantized weights are not converted", "start from unquantized weights")

    def read_rotary_fraction(self, read: "ConfigReader") -> dict[str, Any]:
        """The fraction of each head that rotary embeddings rotate (`rotary_percent`)."""
        read.expect("partial_rotary_factor", 1.0, "rotary embeddings over the whole head are converted")
        return {}

    def read_attention(self, read: "ConfigReader") -> dict[str, Any]:
        read.expect("attention_bias", False, "this architecture is converted without attention biases")
        return {}

    def read_window(self, read: "ConfigReader") -> dict[str, Any]:
        read.expect("use_sliding_window", False, "per-layer sliding windows are not implemented for this family")
        read.used("sliding_window")  # without use_sliding_window, transformers ignores it too
        return {}

    def read_sliding_window(self, read: "ConfigReader") -> dict[str, Any]:
        """`sliding_window` on every layer: the token itself and the window-1 before it."""
        window = read.int("sliding_window", default=None, required=False)
        return {"window_size": (window - 1, 0) if window is not None else None}

    def read_layer_types(self, read: "ConfigReader") -> None:
        layer_types = read.hf.get("layer_types")
        read.used("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            read.refuse("layer_types", f"{show(layer_types)}: per-layer attention types are not implemented", "")

    def read_mlp(self, read: "ConfigReader", kw: dict[str, Any]) -> dict[str, Any]:
        """Mixture-of-experts fields (dense: none)."""
        return {}

    def read_rope(self, read: "ConfigReader") -> dict[str, Any]:
        """rotary_base and scaling from `rope_theta`/`rope_scaling` (transformers 4) or
        `rope_parameters` (transformers 5)."""
        out = read_rope_theta(read)
        scaling, field, kind = rope_scaling_of(read)
        if kind == "default":
            return out
        if kind in ("linear", "llama3"):
            factor = scaling.get("factor")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
                read.refuse(f"{field}.factor", f"{show(factor)} is not a positive number ({kind} rope scaling needs one)",
                            f"give {field}.factor as the model was trained")  # fmt: skip
                return out
        if kind == "linear":
            out["seq_len_interpolation_factor"] = float(factor)
        elif kind == "llama3":
            for key, expected in LLAMA3_ROPE.items():
                if scaling.get(key, expected) != expected:
                    read.refuse(f"{field}.{key}", f"{scaling.get(key)!r} (megatron-core implements {expected})", "")
            out.update(rope_scaling=True, rope_scaling_factor=float(factor))
        else:
            read.refuse(f"{field}.rope_type", f"{kind!r} is not implemented (default, linear and llama3 are)", "")
        return out

    # ------------------------------------------------------------------ provider -> config.json
    def settings(self) -> dict[str, Any]:
        """Provider field -> the value this architecture has (or a predicate on the value).
        A provider with any other value cannot be written as this architecture."""
        return {
            "normalization": "RMSNorm",
            "gated_linear_unit": True,
            "activation_func": is_silu,
            "position_embedding_type": "rope",
            "add_bias_linear": False,
            "rotary_percent": 1.0,
            "rotary_interleaved": False,
            "add_qkv_bias": False,
            "qk_layernorm": False,
            "qk_layernorm_per_head": True,
            "input_layernorms": True,
            "output_layernorms": False,
            "window_size": None,
            "window_attn_skip_freq": None,
            "local_rotary_base": None,
            "softmax_scale": None,
            "layernorm_zero_centered_gamma": False,
            "scale_embeddings": False,
            "attention_logit_softcap": None,
            "output_logit_softcap": None,
            "softmax_type": "vanilla",
            "activation_func_clamp_value": None,
            "glu_linear_offset": 0.0,
            "num_moe_experts": no_experts,
            "moe_shared_expert_intermediate_size": None,
            "multi_latent_attention": False,
            "moe_router_score_function": "softmax",
            "moe_router_enable_expert_bias": False,
            "moe_router_group_topk": None,
            "moe_router_topk_scaling_factor": None,
            "moe_layer_freq": 1,
        }

    def skipped_tensors(self, hf: dict) -> Optional[str]:
        """A regular expression matching the Hugging Face tensors of config.json `hf` that the
        conversion leaves out on purpose (None: none); `skipped_reason` says why, in the log."""
        return None

    def skipped_reason(self) -> str:
        return "not converted"

    def exported_config(self, hf: dict) -> dict:
        """The config.json of the Hugging Face model an export came from, as the export writes
        it (what the export leaves out changed)."""
        return hf

    def mismatches(self, provider: Any) -> list[tuple[str, Any]]:
        """(field, value) for each provider setting this architecture cannot express."""
        out = []
        for name, want in self.settings().items():
            value = getattr(provider, name)
            if not (want(value) if callable(want) else value == want):
                out.append((name, value))
        return out

    def hf_config(self, p: Any, dtype: str) -> dict[str, Any]:
        """config.json for provider `p` (finalized), weights in `dtype` ('bfloat16', ...)."""
        heads = p.num_attention_heads
        cfg: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": p.vocab_size,
            "hidden_size": p.hidden_size,
            "intermediate_size": p.ffn_hidden_size,
            "num_hidden_layers": p.num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": p.num_query_groups or heads,
            "head_dim": p.kv_channels,
            "hidden_act": "silu",
            "max_position_embeddings": p.seq_length,
            "rms_norm_eps": p.layernorm_epsilon,
            "rope_theta": float(p.rotary_base),
            "tie_word_embeddings": p.share_embeddings_and_output_weights,
            "attention_dropout": p.attention_dropout,
            "initializer_range": p.init_method_std,
            "dtype": dtype,
            "torch_dtype": dtype,
            "use_cache": True,
        }
        if p.rope_scaling:
            cfg["rope_scaling"] = {"rope_type": "llama3", "factor": p.rope_scaling_factor, **LLAMA3_ROPE}
        elif p.seq_len_interpolation_factor:
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": p.seq_len_interpolation_factor}
        return cfg

    # ------------------------------------------------------------------ weights
    def architecture_of(self, hf: dict) -> Architecture:
        """The sizes of an accepted config.json."""
        heads = hf["num_attention_heads"]
        return Architecture(
            family=self,
            num_layers=hf["num_hidden_layers"],
            hidden=hf["hidden_size"],
            heads=heads,
            groups=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab=hf["vocab_size"],
            tied=bool(hf.get("tie_word_embeddings", False)),
            ffn=hf.get("intermediate_size", 0),
            **self.experts_of(hf),
        )

    def experts_of(self, hf: dict) -> dict[str, int]:
        """`num_experts` and `moe_ffn` of a config.json (dense: none)."""
        return {}

    def global_tensors(self, a: Architecture) -> dict[str, Mapped]:
        """Embedding, final norm and output layer."""
        h = a.hidden
        output = (
            Vocab("model.embed_tokens.weight", a.vocab, export=False) if a.tied else Vocab("lm_head.weight", a.vocab)
        )
        return {
            "embedding.word_embeddings.weight": Mapped((a.vocab, h), Vocab("model.embed_tokens.weight", a.vocab)),
            "decoder.final_layernorm.weight": Mapped((h,), Copy("model.norm.weight")),
            "output_layer.weight": Mapped((a.vocab, h), output),
        }

    def layer_tensors(self, a: Architecture, L: int) -> dict[str, Mapped]:
        """The parameters of transformer layer `L`, named within the layer as megatron-core's
        local layers name them (`self_attention.linear_qkv.weight`)."""
        return {**self.norm_tensors(a, L), **self.attention_tensors(a, L), **self.mlp_tensors(a, L)}

    def norm_tensors(self, a: Architecture, L: int) -> dict[str, Mapped]:
        p = f"model.layers.{L}"
        return {
            "input_layernorm.weight": Mapped((a.hidden,), Copy(f"{p}.input_layernorm.weight")),
            "pre_mlp_layernorm.weight": Mapped((a.hidden,), Copy(f"{p}.post_attention_layernorm.weight")),
        }

    def qkv_rows(self, a: Architecture) -> int:
        return (a.heads + 2 * a.groups) * a.head_dim

    def qkv(self, a: Architecture, L: int, kind: str) -> QKV:
        attn = f"model.layers.{L}.self_attn"
        return QKV(
            f"{attn}.q_proj.{kind}", f"{attn}.k_proj.{kind}", f"{attn}.v_proj.{kind}", a.heads, a.groups, a.head_dim
        )

    def attention_tensors(self, a: Architecture, L: int) -> dict[str, Mapped]:
        attn = f"model.layers.{L}.self_attn"
        return {
            "self_attention.linear_qkv.weight": Mapped((self.qkv_rows(a), a.hidden), self.qkv(a, L, "weight")),
            "self_attention.linear_proj.weight": Mapped(
                (a.hidden, a.heads * a.head_dim), Copy(f"{attn}.o_proj.weight")
            ),
        }

    def mlp_tensors(self, a: Architecture, L: int) -> dict[str, Mapped]:
        if a.num_experts:
            return {"mlp.router.weight": Mapped((a.num_experts, a.hidden), Copy(self.router_name(L)))}
        p = f"model.layers.{L}.mlp"
        return {
            "mlp.linear_fc1.weight": Mapped(
                (2 * a.ffn, a.hidden), Gated(f"{p}.gate_proj.weight", f"{p}.up_proj.weight")
            ),
            "mlp.linear_fc2.weight": Mapped((a.hidden, a.ffn), Copy(f"{p}.down_proj.weight")),
        }

    def router_name(self, L: int) -> str:
        return f"model.layers.{L}.mlp.gate.weight"

    def expert_names(self, L: int, E: int) -> tuple[str, str, str]:
        """(gate, up, down) tensor names of one expert."""
        base = f"model.layers.{L}.mlp.experts.{E}"
        return f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight"

    def expert_tensors(self, a: Architecture, L: int, E: int) -> dict[str, Mapped]:
        """The parameters of expert `E` of layer `L`, named within the expert (`linear_fc1.weight`)."""
        gate, up, down = self.expert_names(L, E)
        return {
            "linear_fc1.weight": Mapped((2 * a.moe_ffn, a.hidden), Gated(gate, up)),
            "linear_fc2.weight": Mapped((a.hidden, a.moe_ffn), Copy(down)),
        }
