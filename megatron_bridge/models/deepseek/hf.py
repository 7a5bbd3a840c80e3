"""DeepSeek-V3's Hugging Face architecture, `DeepseekV3ForCausalLM` (also DeepSeek-R1, Kimi K2 and
Moonlight): how its config.json becomes a `DeepSeekModelProvider` (refusing by field what
megatron-core computes otherwise), the config.json of a provider, and which tensors make each
parameter, including the rotary rows that files store in halves (`RopeRows`) and the expert bias
kept in fp32 (`Float32`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from megatron_bridge.config.errors import show
from megatron_bridge.models.deepseek.providers import DeepSeekModelProvider, dense_then_moe, leading_dense_layers
from megatron_bridge.models.hf.family import HFFamily, has_experts, read_rope_theta, rope_scaling_of
from megatron_bridge.models.hf.mapping import Architecture, Copy, Gated, Mapped, Rule
from megatron_bridge.models.hf.registry import register

logger = logging.getLogger("megatron_bridge")


class RopeRows(Rule):
    """A projection whose rows hold, per block of `block` rows, `rope` rotary rows at the end, and
    whose Hugging Face file lays each rotary part out in halves (`rope_interleave=false`: the
    first half rotates with the second). megatron-core's MLA reads its rotary rows as interleaved
    pairs (x0, x1), (x2, x3), ..., so its rows are the file's interleaved: row 2i is the file's
    row i, row 2i+1 the file's row rope/2 + i."""

    reorders_rows = True

    def __init__(self, name: str, block: int, rope: int):
        self.name, self.block, self.rope = name, block, rope

    @property
    def hf(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.name,)

    def _source_rows(self, rows: int):
        """For each megatron-core row, its row in the file."""
        import torch

        index = torch.arange(rows).view(-1, self.block)
        half = self.rope // 2
        rotary = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
        first = index[:, self.block - self.rope].unsqueeze(1)
        index[:, self.block - self.rope :] = first + rotary
        return index.reshape(-1)

    def load(self, reader, dest, part):
        if part.dim not in (None, 0):
            raise ValueError(f"{self.name}: rows are split over tensor-parallel ranks, not dimension {part.dim}")
        n = dest.shape[0]
        start = part.rank * n if part.dim == 0 else 0
        source = self._source_rows(reader.info(self.name).shape[0])[start : start + n]
        lo, hi = int(source.min()), int(source.max()) + 1
        dest.copy_(reader.read(self.name, 0, lo, hi)[source - lo])

    def to_hf(self, parts, part):
        import torch

        whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        source = self._source_rows(whole.shape[0])
        order = torch.empty_like(source)
        order[source] = torch.arange(whole.shape[0])  # file row -> megatron-core row
        return {self.name: whole[order]}

    def hf_shapes(self, shape):
        return {self.name: tuple(shape)}


class Float32(Copy):
    """A tensor Hugging Face models keep in fp32 (the router's expert bias): written in fp32
    whatever the export dtype."""

    export_dtype = "float32"


def _any(value: Any) -> bool:
    return True


MTP_NOTE = (
    "multi-token-prediction layers are not converted: the model predicts the next token only, as "
    "transformers' DeepseekV3ForCausalLM does"
)


@register
class DeepseekV3Family(HFFamily):
    """`DeepseekV3ForCausalLM` (DeepSeek-V3/R1, Kimi K2, Moonlight): `self_attn.{q_a_proj,
    q_a_layernorm, q_b_proj}` (or `q_proj`), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`,
    `o_proj`; dense `mlp.{gate,up,down}_proj` in the first `first_k_dense_replace` layers, then
    `mlp.gate` (router, `e_score_correction_bias`), `mlp.experts.E.*` and `mlp.shared_experts.*`.

    What transformers computes is converted exactly; a config.json whose math megatron-core
    cannot reproduce is refused naming the field. The multi-token-prediction layers
    (`num_nextn_predict_layers`, stored as layers after the last one) are left out on import
    with a log line, and exports say `num_nextn_predict_layers: 0`."""

    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    provider = DeepSeekModelProvider
    nullable_fields = (*HFFamily.nullable_fields, "q_lora_rank", "moe_router_num_groups", "moe_router_group_topk")
    adapter_modules = {
        "self_attention.linear_q_proj": ("self_attn.q_proj",),
        "self_attention.linear_q_down_proj": ("self_attn.q_a_proj",),
        "self_attention.linear_q_up_proj": ("self_attn.q_b_proj",),
        "self_attention.linear_kv_down_proj": ("self_attn.kv_a_proj_with_mqa",),
        "self_attention.linear_kv_up_proj": ("self_attn.kv_b_proj",),
        "self_attention.linear_proj": ("self_attn.o_proj",),
        "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.linear_fc2": ("mlp.down_proj",),
        "mlp.shared_experts.linear_fc1": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
        "mlp.shared_experts.linear_fc2": ("mlp.shared_experts.down_proj",),
    }

    # ------------------------------------------------------------------ config.json -> provider
    def provider_fields(self, read):
        kw = super().provider_fields(read)
        kw["kv_channels"] = kw.get("v_head_dim")  # see DeepSeekModelProvider.kv_channels
        read.used("head_dim")  # transformers sets it to qk_rope_head_dim
        read.used("qk_head_dim")  # qk_nope_head_dim + qk_rope_head_dim
        read.int("num_nextn_predict_layers", default=0)  # those layers are skipped (skipped_tensors)
        return kw

    def read_attention(self, read):
        read.expect("attention_bias", False, "the MLA projections are converted without biases")
        hf = read.hf
        heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            read.refuse("num_key_value_heads", f"{show(kv_heads)} differs from num_attention_heads={show(heads)} "
                        "(multi-latent attention has a key and a value head per query head)", "")  # fmt: skip
        if "q_lora_rank" not in hf:
            read.refuse("q_lora_rank", "is missing (null for a full query projection)", "add q_lora_rank to config.json")
        rope = read.int("qk_rope_head_dim")
        if rope is not None and rope % 2:
            read.refuse("qk_rope_head_dim", f"{rope} is odd: rotary embeddings rotate pairs of dimensions", "")
        read.bool("rope_interleave", default=True)  # a weight layout (RopeRows), same math
        return dict(
            multi_latent_attention=True,
            qk_layernorm=True,
            q_lora_rank=read.int("q_lora_rank", default=None, required=False),
            kv_lora_rank=read.int("kv_lora_rank"),
            qk_head_dim=read.int("qk_nope_head_dim"),
            qk_pos_emb_head_dim=rope,
            v_head_dim=read.int("v_head_dim"),
        )

    def read_rope(self, read):
        out = read_rope_theta(read)
        scaling, field, kind = rope_scaling_of(read)
        if kind == "default":
            return {**out, "rope_type": "rope", "mscale": 1.0, "mscale_all_dim": 0.0}
        if kind != "yarn":
            read.refuse(f"{field}.rope_type", f"{kind!r} is not implemented (default and yarn are)", "")
            return out
        factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
        for key, value in (("factor", factor), ("original_max_position_embeddings", original)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                read.refuse(f"{field}.{key}", f"{show(value)} is not a positive number", "")
        if scaling.get("attention_factor") is not None:
            read.refuse(f"{field}.attention_factor", f"{show(scaling['attention_factor'])}: an explicit attention "
                        "factor is not implemented (megatron-core derives it from mscale and mscale_all_dim)", "")  # fmt: skip
        if scaling.get("truncate", True) is not True:
            read.refuse(f"{field}.truncate", f"{show(scaling['truncate'])}: megatron-core rounds the YaRN correction "
                        "range to whole dimensions", "")  # fmt: skip
        if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            read.refuse(f"{field}.partial_rotary_factor", f"{show(scaling['partial_rotary_factor'])}: MLA rotates "
                        "the whole rope part of each head", "")  # fmt: skip
        mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if all_dim and not mscale:
            # transformers then scales cos/sin by mscale(factor) alone, which megatron-core's ratio cannot give
            read.refuse(f"{field}.mscale", f"{show(mscale)} with mscale_all_dim={show(all_dim)} is not implemented",
                        "set mscale (DeepSeek-V3: 1.0)")  # fmt: skip
        # without mscale_all_dim transformers scales cos/sin by mscale(factor) and ignores mscale
        mscale, all_dim = (float(mscale), float(all_dim)) if all_dim and mscale else (1.0, 0.0)
        return {
            **out,
            "rope_type": "yarn",
            "rotary_scaling_factor": float(factor) if isinstance(factor, (int, float)) else 1.0,
            "original_max_position_embeddings": int(original) if isinstance(original, (int, float)) else 1,
            "beta_fast": float(scaling.get("beta_fast") or 32),
            "beta_slow": float(scaling.get("beta_slow") or 1),
            "mscale": mscale,
            "mscale_all_dim": all_dim,
        }

    def read_mlp(self, read, kw):
        hf = read.hf
        experts, topk = read.int("n_routed_experts"), read.int("num_experts_per_tok")
        moe_ffn, shared = read.int("moe_intermediate_size"), read.int("n_shared_experts")
        dense, layers = read.int("first_k_dense_replace"), kw.get("num_layers")
        groups, chosen = read.int("n_group"), read.int("topk_group")
        for key in ("routed_scaling_factor", "norm_topk_prob"):
            if hf.get(key) is None:
                read.refuse(key, "is missing", f"add {key} to config.json")
        scaling = read.float("routed_scaling_factor", default=1.0)
        normalized = read.bool("norm_topk_prob", default=True)
        read.expect("scoring_func", "sigmoid", "transformers scores experts with a sigmoid")
        read.expect("topk_method", "noaux_tc", "transformers routes with the expert bias and expert groups")
        read.expect("moe_layer_freq", 1, "transformers makes every layer after first_k_dense_replace MoE")
        read.used("ep_size")  # a parallel layout, not the math
        if None in (experts, topk, moe_ffn, shared, dense, layers, groups, chosen):
            return {}
        if not experts or not topk or topk > experts:
            read.refuse("num_experts_per_tok", f"{topk} of n_routed_experts={experts} experts", "")
        if shared < 1:
            read.refuse("n_shared_experts", f"{shared}: converted with at least one shared expert", "")
        if dense > layers:
            read.refuse("first_k_dense_replace", f"{dense} exceeds num_hidden_layers={layers}", "")
        if normalized != (topk > 1):
            # megatron-core's sigmoid router normalizes the chosen weights exactly when it chooses several
            read.refuse("norm_topk_prob", f"{normalized} with num_experts_per_tok={topk} is not implemented",
                        f"convert a model with norm_topk_prob={topk > 1}")  # fmt: skip
        limited = False
        if not groups or experts % groups or experts // groups < 2:
            read.refuse("n_group", f"{groups}: the {experts} experts must split into groups of at least 2", "")
        elif not chosen or chosen > groups:
            read.refuse("topk_group", f"{chosen} of n_group={groups} groups", "")
        elif chosen < groups:
            limited = True
            if topk // chosen != 2:
                read.refuse("topk_group", f"{chosen} with num_experts_per_tok={topk}: transformers ranks a group by "
                            f"its 2 best experts, megatron-core by its num_experts_per_tok/topk_group = {topk // chosen}",
                            "convert a model with num_experts_per_tok = 2 x topk_group")  # fmt: skip
        return dict(
            num_moe_experts=experts,
            moe_router_topk=topk,
            moe_ffn_hidden_size=moe_ffn,
            moe_shared_expert_intermediate_size=shared * moe_ffn,
            moe_layer_freq=dense_then_moe(min(dense, layers), layers),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=scaling,
            moe_router_num_groups=groups if limited else None,
            moe_router_group_topk=chosen if limited else None,
            moe_router_load_balancing_type="seq_aux_loss" if read.bool("seq_aux", default=True) else "aux_loss",
            moe_aux_loss_coeff=read.float("aux_loss_alpha", default=1e-3),
        )

    def skipped_tensors(self, hf: dict) -> Optional[str]:
        layers, mtp = hf.get("num_hidden_layers"), hf.get("num_nextn_predict_layers") or 0
        if not isinstance(layers, int) or not isinstance(mtp, int) or mtp <= 0:
            return None
        numbers = "|".join(str(layers + i) for i in range(mtp))
        return rf"^model\.layers\.({numbers})\."

    def skipped_reason(self) -> str:
        return MTP_NOTE

    # ------------------------------------------------------------------ provider -> config.json
    def settings(self):
        return {
            **super().settings(),
            "multi_latent_attention": True,
            "qk_layernorm": True,
            "num_moe_experts": has_experts,
            "moe_shared_expert_intermediate_size": lambda v: bool(v),
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            # checked together with other fields in `mismatches`
            "moe_router_group_topk": _any,
            "moe_router_topk_scaling_factor": _any,
            "moe_layer_freq": _any,
        }

    def mismatches(self, provider):
        p, out = provider, super().mismatches(provider)
        if out:
            return out
        if p.moe_shared_expert_intermediate_size % (p.moe_ffn_hidden_size or p.ffn_hidden_size):
            out.append(("moe_shared_expert_intermediate_size", p.moe_shared_expert_intermediate_size))
        if leading_dense_layers(p) is None:
            out.append(("moe_layer_freq", p.moe_layer_freq))
        groups, chosen = p.moe_router_num_groups, p.moe_router_group_topk
        if chosen and groups and chosen < groups and p.moe_router_topk // chosen != 2:
            out.append(("moe_router_group_topk", chosen))
        if p.rope_type == "yarn" and not (p.mscale_all_dim and p.mscale) and (p.mscale, p.mscale_all_dim) != (1.0, 0.0):
            out.append(("mscale", p.mscale))
        return out

    def hf_config(self, p, dtype):
        cfg = super().hf_config(p, dtype)
        moe_ffn = p.moe_ffn_hidden_size or p.ffn_hidden_size
        cfg.update(
            head_dim=p.qk_pos_emb_head_dim,
            num_key_value_heads=p.num_attention_heads,
            q_lora_rank=p.q_lora_rank,
            kv_lora_rank=p.kv_lora_rank,
            qk_nope_head_dim=p.qk_head_dim,
            qk_rope_head_dim=p.qk_pos_emb_head_dim,
            v_head_dim=p.v_head_dim,
            rope_interleave=True,
            attention_bias=False,
            n_routed_experts=p.num_moe_experts,
            num_experts_per_tok=p.moe_router_topk,
            moe_intermediate_size=moe_ffn,
            n_shared_experts=p.moe_shared_expert_intermediate_size // moe_ffn,
            first_k_dense_replace=leading_dense_layers(p),
            routed_scaling_factor=p.moe_router_topk_scaling_factor or 1.0,
            n_group=p.moe_router_num_groups or 1,
            topk_group=p.moe_router_group_topk or 1,
            norm_topk_prob=p.moe_router_topk > 1,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            num_nextn_predict_layers=0,
        )
        if p.rope_type == "yarn":
            cfg["rope_scaling"] = {
                "rope_type": "yarn", "factor": p.rotary_scaling_factor,
                "original_max_position_embeddings": p.original_max_position_embeddings, "beta_fast": p.beta_fast,
                "beta_slow": p.beta_slow, "mscale": p.mscale, "mscale_all_dim": p.mscale_all_dim,
            }  # fmt: skip
        return cfg

    def exported_config(self, hf: dict) -> dict:
        """The origin's config.json as exports write it: without multi-token-prediction layers."""
        return {**hf, "num_nextn_predict_layers": 0} if hf.get("num_nextn_predict_layers") else hf

    # ------------------------------------------------------------------ weights
    def architecture_of(self, hf):
        heads = hf["num_attention_heads"]
        return Architecture(
            family=self, num_layers=hf["num_hidden_layers"], hidden=hf["hidden_size"], heads=heads, groups=heads,
            head_dim=hf["qk_rope_head_dim"], vocab=hf["vocab_size"], tied=bool(hf.get("tie_word_embeddings", False)),
            ffn=hf.get("intermediate_size", 0), num_experts=hf["n_routed_experts"], moe_ffn=hf["moe_intermediate_size"],
            hf=hf,
        )  # fmt: skip

    def is_dense(self, a: Architecture, L: int) -> bool:
        return L < a.hf["first_k_dense_replace"]

    def attention_tensors(self, a, L):
        hf, attn = a.hf, f"model.layers.{L}.self_attn"
        rope, nope, v = hf["qk_rope_head_dim"], hf["qk_nope_head_dim"], hf["v_head_dim"]
        q_lora, kv_lora = hf.get("q_lora_rank"), hf["kv_lora_rank"]
        q_rows, kv_down = a.heads * (nope + rope), kv_lora + rope

        def rotary(name: str, block: int) -> Rule:
            return Copy(name) if hf.get("rope_interleave", True) else RopeRows(name, block, rope)

        out = {
            "self_attention.linear_kv_down_proj.weight": Mapped(
                (kv_down, a.hidden), rotary(f"{attn}.kv_a_proj_with_mqa.weight", kv_down)
            ),
            "self_attention.kv_layernorm.weight": Mapped((kv_lora,), Copy(f"{attn}.kv_a_layernorm.weight")),
            "self_attention.linear_kv_up_proj.weight": Mapped(
                (a.heads * (nope + v), kv_lora), Copy(f"{attn}.kv_b_proj.weight")
            ),
            "self_attention.linear_proj.weight": Mapped((a.hidden, a.heads * v), Copy(f"{attn}.o_proj.weight")),
        }
        if q_lora is None:
            out["self_attention.linear_q_proj.weight"] = Mapped(
                (q_rows, a.hidden), rotary(f"{attn}.q_proj.weight", nope + rope)
            )
        else:
            out["self_attention.linear_q_down_proj.weight"] = Mapped((q_lora, a.hidden), Copy(f"{attn}.q_a_proj.weight"))
            out["self_attention.q_layernorm.weight"] = Mapped((q_lora,), Copy(f"{attn}.q_a_layernorm.weight"))
            out["self_attention.linear_q_up_proj.weight"] = Mapped(
                (q_rows, q_lora), rotary(f"{attn}.q_b_proj.weight", nope + rope)
            )
        return out

    def mlp_tensors(self, a, L):
        if self.is_dense(a, L):
            return super().mlp_tensors(dataclasses.replace(a, num_experts=0), L)
        p = f"model.layers.{L}.mlp"
        shared = a.hf["n_shared_experts"] * a.moe_ffn
        return {
            "mlp.router.weight": Mapped((a.num_experts, a.hidden), Copy(f"{p}.gate.weight")),
            "mlp.router.expert_bias": Mapped((a.num_experts,), Float32(f"{p}.gate.e_score_correction_bias")),
            "mlp.shared_experts.linear_fc1.weight": Mapped(
                (2 * shared, a.hidden), Gated(f"{p}.shared_experts.gate_proj.weight", f"{p}.shared_experts.up_proj.weight")
            ),
            "mlp.shared_experts.linear_fc2.weight": Mapped((a.hidden, shared), Copy(f"{p}.shared_experts.down_proj.weight")),
        }

    def expert_tensors(self, a, L, E):
        return {} if self.is_dense(a, L) else super().expert_tensors(a, L, E)
