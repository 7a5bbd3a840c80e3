"""The planner: exact model-state bytes against megatron-core, the activation formula, the
pipeline split, fixes that are re-planned and valid, and the CLI."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from factories import backend_for, torchrun

from megatron_bridge.cli.main import main as mbridge
from megatron_bridge.planning import plan
from megatron_bridge.planning.activations import in_flight_micro_batches, layer_bytes, layer_terms
from megatron_bridge.planning.inputs import PlanInputs
from megatron_bridge.planning.params import chunks
from megatron_bridge.training.config import runtime_config_update
from megatron_bridge.config.overrides import process_config_with_overrides
from recipes import get_recipe, list_recipes

SCRIPT = Path(__file__).parent / "scripts" / "measure_memory.py"
LAYOUTS = (
    "tp2", "pp2", "dp2_distopt", "moe_ep2", "bf16_fp32_main", "buckets_bf16", "pp2_vp2_distopt", "tp2_output_norms",
    "mla_moe_ep2", "mla_tp2", "lora_tp2", "dora_dp2_distopt", "mla_dora_tp2", "mtp_pp2_distopt", "mla_moe_ep2_mtp",
    "mtp_pp2_vp2_untied",
)  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)  # comm-overlap notes on every resolve
    yield
    logging.disable(logging.NOTSET)


def resolved(name, world_size=None, overrides=(), **options):
    fn = get_recipe(name)
    cfg = fn(**options)
    if overrides:
        process_config_with_overrides(cfg, cli_overrides=list(overrides))
    runtime_config_update(cfg, world_size=world_size or fn.world_size)
    return cfg


# ---------------------------------------------------------------------- exact model state
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_model_state_bytes_equal_megatron_core_allocation_on_every_rank(tmp_path):
    """Thirteen layouts (three of them multi-latent attention, three with multi-token prediction)
    trained for one iteration with pretrain() under torchrun (2 processes), and three LoRA/DoRA
    runs (finetune() of the weights two of them save; one adapts multi-latent attention split
    over TP 2): the bytes of parameters, gradient
    buffers, optimizer state (main copies + moments) and torch's step counters equal the
    planner's on each rank, and so does the parameter list (adapters after their base layer)."""
    out = tmp_path / "memory"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        *torchrun(2),
        str(SCRIPT),
        "--out",
        str(out),
        "--layouts",
        *LAYOUTS,
        "--backend",
        backend_for(2),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    differing_shards = 0
    for rank in (0, 1):
        results = json.loads(Path(f"{out}.rank{rank}").read_text())
        assert set(results) == set(LAYOUTS)
        for layout, r in results.items():
            assert r["measured"] == r["planned"], (layout, rank)
            assert r["names"] == r["planned_names"], (layout, rank)
            assert r["measured"]["params"] > 0 and r["measured"]["optimizer"] > 0
    for layout in ("buckets_bf16", "dp2_distopt"):  # distributed optimizer: the two shards differ, still exact
        a, b = (json.loads(Path(f"{out}.rank{r}").read_text())[layout]["measured"] for r in (0, 1))
        differing_shards += a != b
    assert differing_shards == 2
    # multi-token prediction: the depths and an embedding copy on the last stage only; the MoE
    # model's depth is a mixture-of-experts layer, like its last decoder layer
    results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]
    stages = [[n for n, _ in result["mtp_pp2_distopt"]["names"]] for result in results]
    assert [any(n.startswith("mtp.layers.1.") for n in names) for names in stages] == [False, True]
    assert all("embedding.word_embeddings.weight" in names for names in stages)
    moe_mtp = [n for n, _ in results[0]["mla_moe_ep2_mtp"]["names"]]
    assert any(n.startswith("mtp.layers.0.transformer_layer.mlp.experts.") for n in moe_mtp)
    rank0 = json.loads(Path(f"{out}.rank0").read_text())
    for layout, base in (("lora_tp2", "tp2"), ("dora_dp2_distopt", "tp2"), ("mla_dora_tp2", "mla_tp2")):
        # only adapters have gradients and optimizer state
        peft, full = rank0[layout]["measured"], rank0[base]["measured"]
        assert 0 < peft["grads"] < full["grads"] / 2 and 0 < peft["optimizer"] < full["optimizer"] / 2
        names = [n for n, _ in rank0[layout]["names"]]
        assert any(n.endswith(".lora_A") for n in names) and any(n.endswith(".lora_magnitude") for n in names) == (
            "dora" in layout
        )


def test_bucketed_layout_of_the_measured_config_has_several_padded_buckets():
    """The `buckets_bf16` layout above is the multi-bucket case (bucket padding to lcm(DP, 128))."""
    from megatron_bridge.planning.buffers import chunk_buffers
    from megatron_bridge.planning.params import chunk_params

    sys.path.insert(0, str(SCRIPT.parent.parent))
    from factories import tiny_config, tiny_model

    cfg = tiny_config(
        model=tiny_model(
            share_embeddings_and_output_weights=False,
            add_qkv_bias=True,
            qk_layernorm=True,
            vocab_size=250,
            add_bias_linear=False,
        )
    )
    cfg.tokenizer.vocab_size = 250
    cfg.ddp.use_distributed_optimizer, cfg.ddp.overlap_grad_reduce, cfg.ddp.bucket_size = True, True, 20000
    runtime_config_update(cfg, world_size=2)
    inp = PlanInputs.from_config(cfg)
    (buf,) = chunk_buffers(inp, chunk_params(inp, chunks(inp)[0][0]), True, 0)
    assert len(buf.buckets) >= 3
    assert all((end - start) % 128 == 0 for start, end, _ in buf.buckets)
    assert buf.numel > sum(p.numel for p in chunk_params(inp, chunks(inp)[0][0]))


# ---------------------------------------------------------------------- activations
def paper_inputs(**changes):
    """The architecture of Korthikanti et al.: MHA, 4h GeLU MLP, dropout, LayerNorm, no rotary
    embedding, unfused attention with a 16-bit softmax, 16-bit activations."""
    cfg = resolved("llama2_7b_pretrain_config")
    inp = PlanInputs.from_config(cfg)
    base = dict(
        hidden=4096,
        heads=32,
        query_groups=32,
        kv_channels=128,
        ffn=4 * 4096,
        gated=False,
        seq_length=2048,
        micro_batch_size=2,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        transformer_engine=False,
        core_attention="unfused",
        softmax_in_fp32=False,
        rotary_dim=0,
        norm_has_bias=True,
        qk_layernorm=False,
        activation_bytes=2,
        tp=1,
        cp=1,
        sequence_parallel=False,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        recompute_modules=("core_attn",),
    )
    base.update(changes)
    return inp.replace(**base)


CLOSED_FORMS = [
    (None, False, lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    (None, True, lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    ("selective", False, lambda s, b, h, a, t: s * b * h * (10 + 24 / t)),
    ("selective", True, lambda s, b, h, a, t: 34 * s * b * h / t),
    ("full", False, lambda s, b, h, a, t: 2 * s * b * h),
    ("full", True, lambda s, b, h, a, t: 2 * s * b * h / t),
]


@pytest.mark.parametrize(
    "t, setting, sp, closed_form",
    [(t, *form) for t in (1, 2, 8) for form in CLOSED_FORMS if t > 1 or not form[1]],  # SP needs TP > 1
)
def test_activation_bytes_per_layer_reduce_to_the_closed_forms(t, setting, sp, closed_form):
    extra = dict(recompute_method="uniform", recompute_num_layers=1) if setting == "full" else {}
    inp = paper_inputs(tp=t, sequence_parallel=sp, recompute_granularity=setting, **extra)
    s, b, h, a = 2048, 2, 4096, 32
    # the paper leaves out the norms' fp32 mean and 1/std per token (8 bytes a token, two norms)
    # and, unless the core attention is recomputed, the [s, s] causal mask megatron-core builds per layer
    terms = layer_terms(inp)
    stats = 2 * 8 * s * b / (t if sp else 1)
    assert sum(v for k, v in terms.items() if "statistics" in k) == stats
    mask = terms.get("causal mask (built by each layer)", 0)
    assert mask == (0 if setting == "selective" else s * s)
    kept = layer_bytes(inp) - (0 if setting == "full" else stats + mask)
    assert kept == pytest.approx(closed_form(s, b, h, a, t), rel=1e-12)


def test_activation_terms_for_a_modern_layer():
    """GQA, SwiGLU, no dropout, fused attention: Q/K/V shrink to the query groups, no masks, the
    attention scores are not kept; context parallelism splits every term."""
    inp = paper_inputs(
        query_groups=8, gated=True, ffn=14336, hidden_dropout=0.0, attention_dropout=0.0, transformer_engine=True,
        core_attention="te", activation_fused=True,
    )  # fmt: skip
    terms = layer_terms(inp)
    s, b = 2048, 2
    assert terms["Q, K, V"] == 2 * s * b * (4096 + 2 * 1024)
    assert terms["activation input"] == 2 * s * b * 2 * 14336
    assert not any("mask" in k or "softmax output" in k for k in terms)
    assert layer_bytes(inp.replace(cp=2)) == pytest.approx(layer_bytes(inp) / 2)


def test_micro_batches_in_flight_follow_megatron_schedules():
    inp = paper_inputs().replace(
        pp=4, vp=None, global_batch_size=64, micro_batch_size=1, world_size=4, microbatch_group_size=None
    )
    assert [in_flight_micro_batches(inp, r) for r in range(4)] == [4, 3, 2, 1]
    few = inp.replace(global_batch_size=2)
    assert in_flight_micro_batches(few, 0) == 2
    inter = inp.replace(vp=2)
    # rank 0: 2 (p - 1) + (v - 1) p + 1 = 11 chunks of half a stage
    assert in_flight_micro_batches(inter, 0) == 11 / 2
    assert in_flight_micro_batches(inp.replace(pp=1, world_size=1), 0) == 1


# ---------------------------------------------------------------------- pipeline split
@pytest.mark.parametrize(
    "fields",
    [
        dict(num_layers=8, pipeline_model_parallel_size=2),
        dict(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        dict(
            num_layers=14,
            pipeline_model_parallel_size=4,
            virtual_pipeline_model_parallel_size=2,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
        dict(
            num_layers=10,
            pipeline_model_parallel_size=4,
            num_layers_in_first_pipeline_stage=1,
            num_layers_in_last_pipeline_stage=3,
        ),
    ],
)
def test_pipeline_split_matches_megatron_core(fields):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    sys.path.insert(0, str(SCRIPT.parent.parent))
    from factories import tiny_config, tiny_model

    cfg = tiny_config(model=tiny_model(**fields))
    cfg.train.global_batch_size = 8
    runtime_config_update(cfg, world_size=fields["pipeline_model_parallel_size"])
    inp = PlanInputs.from_config(cfg)
    for stage in chunks(inp):
        for c in stage:
            assert c.num_layers == get_num_layers_to_build(cfg.model, vp_stage=c.vp_stage, pp_rank=c.pp_rank)
            assert c.first_layer == get_transformer_layer_offset(cfg.model, vp_stage=c.vp_stage, pp_rank=c.pp_rank)


# ---------------------------------------------------------------------- plans and fixes
def test_every_recipe_plans_and_llama3_8b_fits_on_8_h100(tmp_path):
    from megatron_bridge.cli.dry_run import for_target

    # as docs/planner.md plans them (--plan-only: GPUs with TransformerEngine), each recipe fits
    # the H100s of its world size; fine-tuning recipes with stand-in paths (planning reads none)
    stand_ins = dict(dataset_root=str(tmp_path), pretrained_checkpoint=str(tmp_path))
    with for_target(True):
        for name in list_recipes():
            p = plan(resolved(name, **(stand_ins if name.endswith("_finetune_config") else {})))
            assert p.ranks and p.timing.tokens_per_s > 0
            assert p.fits, (name, p.worst.margin / 2**30)
    p = plan(resolved("llama3_8b_pretrain_config"))
    (rank,) = p.ranks
    # 8.03B bf16 parameters, fp32 gradients, 12 bytes/param of optimizer state over DP x CP = 8
    assert rank.state.params == pytest.approx(8.03e9 * 2, rel=0.01)
    assert rank.state.grads == 2 * rank.state.params
    assert rank.state.optimizer == pytest.approx(8.03e9 * 12 / 8, rel=0.01)
    assert p.fits and 0 < rank.margin < 2**30


def test_multi_token_prediction_is_planned_on_the_last_stage_and_what_it_cannot_plan_is_named(tmp_path):
    """Moonlight with one prediction depth: its parameters and activations are planned (exact
    against megatron-core in the allocation test above); LoRA on it and full uniform recompute of
    more than one layer per unit (megatron-core asserts one for its depths) are refused by name."""
    from megatron_bridge.planning import PlanningError

    plain = plan(resolved("moonlight_16b_pretrain_config"), with_fixes=False)
    cfg = resolved("moonlight_16b_pretrain_config", overrides=["model.mtp_num_layers=1"])
    p = plan(cfg, with_fixes=False)
    (rank,), (before,) = p.ranks, plain.ranks
    assert p.inputs.mtp_depths == 1 and p.inputs.moe_layer_pattern[-1]
    assert rank.state.params > before.state.params and rank.state.grads > before.state.grads
    # the depth's loss keeps the fp32 softmax of its logits until the backward pass
    s, vocab = cfg.model.seq_length, p.inputs.padded_vocab
    assert rank.activations.per_micro_batch - before.activations.per_micro_batch > 4 * s * vocab
    assert "multi-token prediction: 1 depth on every rank" in "\n".join(p.text())
    (record,) = p.to_json()
    assert record["mtp_depths"] == 1

    lora = ["model.mtp_num_layers=1", "peft=lora", "peft.dim=8", "peft.target_modules=[linear_proj]",
            f"checkpoint.pretrained_checkpoint={tmp_path}", "model.transformer_impl=local"]  # fmt: skip
    with pytest.raises(PlanningError, match=r"LoRA/DoRA with multi-token prediction \(model.mtp_num_layers\) is not"):
        plan(resolved("moonlight_16b_pretrain_config", overrides=lora))
    recompute = ["model.mtp_num_layers=1", "model.recompute_granularity=full", "model.recompute_method=uniform",
                 "model.recompute_num_layers=3"]  # fmt: skip
    with pytest.raises(PlanningError, match=r"recompute of model.recompute_num_layers=3 layers is not modeled"):
        plan(resolved("moonlight_16b_pretrain_config", overrides=recompute))


@pytest.mark.timeout(300)
def test_dry_run_of_a_config_with_multi_token_prediction_prints_its_plan():
    """DeepSeek-V3 with one prediction depth, as a user runs it (a fresh process): the plan is
    appended and names the depth on the last of its 16 stages."""
    cmd = [sys.executable, "-m", "megatron_bridge", "pretrain", "--recipe", "deepseek_v3_pretrain_config",
           "--dry-run", "model.mtp_num_layers=1"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    plan_part = out.stdout[out.stdout.index("# ---- plan:") :]
    assert "# multi-token prediction: 1 depth on stage 15, with a copy of the word embedding" in plan_part
    assert "mixture-of-experts layer like the last decoder layer" in plan_part
    assert "# fits: yes" in plan_part


def test_lora_on_multi_latent_attention_is_planned_on_its_projections(tmp_path):
    """Moonlight (multi-latent attention, full query projection) with LoRA on its attention
    projections: the default targets name linear_qkv, which multi-latent attention does not have
    (refused before planning); with its own projection names the adapters are planned."""
    from megatron_bridge.config.errors import ConfigValidationError

    lora = ["peft=lora", "peft.dim=16", "model.transformer_impl=local", f"checkpoint.pretrained_checkpoint={tmp_path}"]
    with pytest.raises(ConfigValidationError, match=r"'linear_qkv' matches no module of this model"):
        resolved("moonlight_16b_pretrain_config", overrides=lora)
    targets = "peft.target_modules=[linear_q_proj,linear_kv_down_proj,linear_kv_up_proj,linear_proj]"
    cfg = resolved("moonlight_16b_pretrain_config", overrides=[*lora, targets])
    p = plan(cfg)
    (record,) = p.to_json()
    assert record["peft"] == "lora" and record["layer_impl"] == "local" and record["tp"] == 1
    m, r = cfg.model, 16
    assert m.q_lora_rank is None and m.num_layers == 27
    q_proj = r * (m.hidden_size + m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim))
    kv_down = r * (m.hidden_size + m.kv_lora_rank + m.qk_pos_emb_head_dim)
    kv_up = r * (m.kv_lora_rank + m.num_attention_heads * (m.qk_head_dim + m.v_head_dim))
    proj = r * (m.num_attention_heads * m.v_head_dim + m.hidden_size)
    assert record["trainable_parameters"] == m.num_layers * (q_proj + kv_down + kv_up + proj)
    # gradients and Adam state for the adapters only (fp32 gradients; optimizer state over DP 8)
    assert record["grads_bytes"] < 4 * record["trainable_parameters"] * 1.01
    assert record["optimizer_bytes"] < 12 * record["trainable_parameters"] / 8 * 1.01
    assert "peft: LoRA rank 16 on 108 linear layers" in "\n".join(p.text())


def test_fp8_parameters_are_planned_at_one_byte_per_linear_weight():
    cfg = resolved("llama3_8b_pretrain_config", overrides=["mixed_precision=bf16_with_fp8_current_scaling_mixed"])
    assert cfg.model.fp8_param and cfg.ddp.use_distributed_optimizer  # the preset keeps FP8 parameters here
    (rank,) = plan(cfg).ranks
    embeddings = 2 * 128256 * 4096  # input and output embeddings stay in bf16
    assert rank.state.params == pytest.approx(embeddings * 2 + (8.03e9 - embeddings), rel=0.01)


def test_config_that_does_not_fit_gets_ranked_fixes_that_fit_when_applied():
    """llama3_70b on 8 GPUs with TP=1: each printed fix, applied to the config as its overrides
    (and world size), resolves, and re-planning it fits with the estimate the fix showed."""
    options = dict(tensor_model_parallel_size=1, sequence_parallel=False, tp_comm_overlap=False)
    p = plan(resolved("llama3_70b_pretrain_config", 8, **options))
    assert not p.fits and len(p.fixes) >= 3
    speeds = [f.evaluation.timing.tokens_per_s for f in p.fixes if f.world_size == 8]
    assert speeds == sorted(speeds, reverse=True)
    for fix in p.fixes:
        overrides = [o for o in fix.overrides if not o.startswith("--world-size")]
        cfg = resolved("llama3_70b_pretrain_config", fix.world_size, overrides, **options)
        again = plan(cfg, with_fixes=False)
        assert again.fits, fix.description
        assert again.worst.total == pytest.approx(fix.evaluation.worst.total, rel=1e-9)
    assert any(f.world_size > 8 for f in p.fixes)  # at 8 GPUs only offloading the optimizer fits


def test_fixes_are_minimal_and_the_plan_text_names_them():
    p = plan(resolved("llama3_8b_pretrain_config", 8, ["train.micro_batch_size=2"]))
    assert not p.fits
    for a in p.fixes:
        for b in p.fixes:
            assert a is b or not set(b.overrides) < set(a.overrides)
    text = "\n".join(p.text())
    assert "fits: NO" in text and "fixes (ranked" in text and p.fixes[0].overrides[0] in text


# ---------------------------------------------------------------------- CLI
def test_gpu_choices_of_the_cli_are_the_planner_devices():
    from megatron_bridge.cli.training import GPU_CHOICES
    from megatron_bridge.planning import GPUS

    assert GPU_CHOICES == tuple(GPUS)


def test_plan_only_prints_the_plan(capsys):
    assert mbridge(["pretrain", "--recipe", "llama3_8b_pretrain_config", "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "plan: llama3_8b_pretrain_config on 8 x H100 80GB" in out
    for row in ("parameters", "gradients", "optimizer state", "activations", "workspace allowance", "total"):
        assert f"\n  {row}" in out
    assert "fits: yes" in out and "time at MFU 0.40" in out and "pipeline bubble" in out
    assert "model:" not in out  # no YAML


def test_plan_json_records_and_gpu_and_mfu(capsys):
    argv = ["pretrain", "--recipe", "qwen3_30b_a3b_pretrain_config", "--plan-only", "--json"]
    assert mbridge([*argv, "--gpu", "h200-141gb", "--mfu", "0.2"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == 2  # PP 2: two rank layouts
    for r in records:
        for key in (
            "params_bytes",
            "grads_bytes",
            "optimizer_bytes",
            "activations_bytes",
            "total_bytes",
            "gpu_bytes",
            "fits",
            "step_time_s",
            "tokens_per_s",
        ):
            assert key in r
        assert r["total_bytes"] == pytest.approx(
            r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] + r["activations_bytes"] + r["workspace_bytes"],
            abs=2,
        )
        assert r["gpu"] == "h200-141gb" and r["mfu"] == 0.2 and r["expert_dp"] == 4
    assert mbridge([*argv, "--mfu", "0.4"]) == 0
    faster = json.loads(capsys.readouterr().out)
    assert faster[0]["step_time_s"] == pytest.approx(records[0]["step_time_s"] / 2)


@pytest.mark.timeout(300)
def test_dry_run_of_a_gpu_recipe_says_which_layers_it_planned_and_how_to_choose(capsys):
    """For the GPUs it plans for: TE layers (TE taken as installed there); with --no-te, local
    layers with SDPA (a fresh process, as a user runs it). Either way the line naming the
    settings that choose."""
    assert mbridge(["pretrain", "--recipe", "llama2_7b_pretrain_config", "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "layers: TransformerEngine, TransformerEngine's core attention" in out
    assert "  to choose: model.transformer_impl=local plans megatron-core's local layers" in out
    cmd = [sys.executable, "-m", "megatron_bridge", "pretrain", "--recipe", "llama2_7b_pretrain_config", "--dry-run",
           "--no-te"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "# resolved for:          megatron-core local layers (--no-te" in out.stdout
    assert (
        "# layers: megatron-core local, PyTorch SDPA core attention (TransformerEngine not installed, so local "
        "layers; PyTorch SDPA serves this config" in out.stdout
    )
    assert "#   to choose: model.transformer_impl=transformer_engine plans TransformerEngine layers" in out.stdout
    assert "model.attention_backend=unfused plans megatron-core's DotProductAttention" in out.stdout
    assert "SDPA attention (no scores kept)" in out.stdout


@pytest.mark.timeout(300)
def test_dry_run_without_te_shows_the_sequential_experts_a_gpu_run_takes(capsys, tmp_path):
    """Grouped-GEMM experts are decided for a GPU run only (a default True without TE layers or
    the grouped_gemm package becomes sequential experts): `--dry-run --no-te` of a MoE recipe
    shows that decision and its note (a fresh process); with TE layers the recipe's True stays."""
    from factories import source_tree_env

    from megatron_bridge.models.experts import grouped_gemm_installed

    if grouped_gemm_installed():
        pytest.skip("the grouped_gemm package is installed: grouped experts need no fallback")
    argv = ["pretrain", "--recipe", "mixtral_8x7b_pretrain_config", "--dry-run", "--dir", str(tmp_path)]
    assert mbridge(argv) == 0
    out = capsys.readouterr().out
    assert "\n  moe_grouped_gemm: true\n" in out and "SequentialMLP" not in out
    cmd = [sys.executable, "-m", "megatron_bridge", *argv, "--no-te"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=source_tree_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "\n  moe_grouped_gemm: false\n" in out.stdout
    assert (
        "# note: model.moe_grouped_gemm=False: the grouped_gemm package is not installed and the layers are not "
        "TransformerEngine's; the experts run one GEMM each (SequentialMLP)\n"
    ) in out.stdout
    # the plan alone says so too, as its last line does for the layers
    argv[argv.index("--dry-run")] = "--plan-only"
    out = subprocess.run([sys.executable, "-m", "megatron_bridge", *argv, "--no-te"], capture_output=True, text=True,
                         timeout=280, env=source_tree_env())  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.rstrip().endswith("; the experts run one GEMM each (SequentialMLP: model.moe_grouped_gemm=False))")


@pytest.mark.timeout(300)
def test_dry_run_of_lora_on_a_moe_model_takes_the_sequential_experts_it_will_train(tmp_path):
    """LoRA wraps sequential experts only; a GPU run without a grouped GEMM turns the model's
    default grouped experts into sequential ones before its checks, and so does the dry run of a
    LoRA recipe on a Qwen3-MoE directory (config.json and index only): it resolves (a fresh
    process)."""
    from factories import source_tree_env
    from hf_models import family_configs

    from megatron_bridge.models.experts import grouped_gemm_installed
    from megatron_bridge.models.hf.load import expected_weights

    if grouped_gemm_installed():
        pytest.skip("the grouped_gemm package is installed: the experts stay grouped, and LoRA refuses them")
    hf = tmp_path / "qwen3-moe"
    hf.mkdir()
    config = {**family_configs()["qwen3_moe"].to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    (hf / "config.json").write_text(json.dumps(config))
    weight_map = {name: "model.safetensors" for name in expected_weights(config)[1]}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    data = tmp_path / "sft"
    data.mkdir()
    for split in ("training", "validation"):
        (data / f"{split}.jsonl").write_text(json.dumps({"input": "5 6 7", "output": "8 9"}) + "\n")
    cmd = [sys.executable, "-m", "megatron_bridge", "finetune", "--recipe", "qwen3_8b_lora_finetune_config",
           "--recipe-arg", f"pretrained={hf}", "--recipe-arg", f"dataset_root={data}", "--dir", str(tmp_path),
           "--dry-run"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=source_tree_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "\n  moe_grouped_gemm: false\n" in out.stdout
    assert "# note: model.moe_grouped_gemm=False: the grouped_gemm package is not installed" in out.stdout


def test_plan_of_a_model_without_input_norms_offers_no_transformer_engine_layers(capsys, tmp_path):
    """OLMo 2 (no norms before attention and MLP) is built on local layers only: its plan does not
    suggest TE layers."""
    assert mbridge(["pretrain", "--recipe", "olmo2_7b_pretrain_config", "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "layers: megatron-core local, PyTorch SDPA core attention" in out
    assert "  to choose: model.attention_backend=unfused plans megatron-core's DotProductAttention (no " in out
    assert "transformer_impl=transformer_engine" not in out


def test_lora_recipe_is_planned_with_a_frozen_base(capsys, tmp_path):
    argv = ["finetune", "--recipe", "llama3_8b_lora_finetune_config", "--plan-only", "--json",
            "--recipe-arg", f"pretrained_checkpoint={tmp_path}",
            "--recipe-arg", f"dataset_root={tmp_path}"]  # fmt: skip
    assert mbridge(argv) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["peft"] == "lora" and record["layer_impl"] == "local"
    # rank 16 on the four projections of 32 layers: 16 x (4096 + 6144) + 16 x (4096 + 4096) + 16 x (4096 + 28672)
    # + 16 x (14336 + 4096) per layer
    assert record["trainable_parameters"] == 32 * 16 * (4096 + 6144 + 4096 + 4096 + 4096 + 28672 + 14336 + 4096)
    assert record["frozen_parameters"] > 8e9 and record["params_bytes"] > 2 * record["frozen_parameters"]
    # gradients and Adam state (fp32 main params + moments, sharded over DP 8) for the adapters only
    assert record["grads_bytes"] < 4 * record["trainable_parameters"] * 1.01
    assert record["optimizer_bytes"] < 12 * record["trainable_parameters"] / 8 * 1.01
    assert mbridge(argv[:-5] + argv[-4:]) == 0  # the text plan
    assert "peft: LoRA rank 16 on 128 linear layers" in capsys.readouterr().out


def test_dry_run_appends_the_plan_as_comments(capsys):
    assert mbridge(["pretrain", "--recipe", "llama3_70b_pretrain_config", "--dry-run", "--gpu", "b200-180gb"]) == 0
    out = capsys.readouterr().out
    plan_part = out[out.index("# ---- plan:") :]
    assert "on 64 x B200 180GB" in plan_part
    assert all(line.startswith("#") for line in plan_part.splitlines())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--plan-only", "--mfu", "1.5"], "expected a number in (0, 1], got '1.5'"),
        (["--plan-only", "--gpu", "h100"], "invalid choice: 'h100'"),
        (["--mfu", "0.3"], "--mfu only applies to --dry-run and --plan-only"),
        (["--gpu", "a100-80gb"], "--gpu only applies to --dry-run and --plan-only"),
        (["--no-te"], "--no-te only applies to --dry-run and --plan-only"),
        (["--dry-run", "--json"], "--json only applies to --plan-only"),
        (
            ["--plan-only", "ddp.use_megatron_fsdp=true"],
            "ddp.use_megatron_fsdp",  # refused by the config before the planner sees it
        ),
    ],
)
def test_plan_option_errors(capsys, argv, message):
    assert mbridge(["pretrain", "--recipe", "llama3_8b_pretrain_config", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_cpu_run_that_cannot_fit_in_host_memory_is_refused_before_allocating(monkeypatch):
    """A micro batch, sequence or vocabulary too large for this machine failed at its first large
    allocation ("can't allocate memory") after the model was built, or swapped until the OOM killer
    came; the plan of the resolved config is held against the memory available."""
    from megatron_bridge.config.errors import ConfigValidationError
    from megatron_bridge.training.memory_fit import WORKER_BYTES, dataloader_workers, refuse_what_host_memory_cannot_hold
    from recipes import tiny_gpt_pretrain_config

    cfg = tiny_gpt_pretrain_config()
    process_config_with_overrides(cfg, cli_overrides=["train.micro_batch_size=1000", "train.global_batch_size=1000", "dataset.num_workers=2"])
    runtime_config_update(cfg, device="cpu")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    worst = plan(cfg, with_fixes=False).worst
    needed = worst.state.params + worst.state.grads + worst.state.optimizer + worst.activations.total
    assert 2**30 < needed < 2**31  # activations of 1000 sequences of 512 tokens
    workers = dataloader_workers(cfg) * WORKER_BYTES
    assert dataloader_workers(cfg) == 3 * cfg.dataset.num_workers > 0  # train, validation and test loaders
    refuse_what_host_memory_cannot_hold(cfg, available=int(needed) + workers)  # fits exactly
    with pytest.raises(ConfigValidationError) as err:
        refuse_what_host_memory_cannot_hold(cfg, available=2**30)
    (message,) = err.value.errors
    assert message.startswith(f"<config>: this CPU run needs about {needed / 2**30:,.1f} GiB of memory per process (parameters 0.00, ")
    assert message.endswith("and this machine has 1.0 GiB available (`--plan-only` shows where it goes; make the model, "
                            "train.micro_batch_size or model.seq_length smaller)")  # fmt: skip
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes on this machine need twice as much
    with pytest.raises(ConfigValidationError, match=" x 2 processes on this machine, and this machine has "):
        refuse_what_host_memory_cannot_hold(cfg, available=int(needed) + workers)
    refuse_what_host_memory_cannot_hold(cfg, on_cpu=False, available=2**30)  # a GPU run: only the workers count here
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    cfg.dataset.num_workers = 5000  # 15,000 forked processes
    with pytest.raises(ConfigValidationError) as err:
        refuse_what_host_memory_cannot_hold(cfg, on_cpu=False, available=64 * 2**30)
    assert err.value.errors == [
        "dataset.num_workers: 5000 workers for each of the run's data loaders fork 15,000 processes per training process, "
        "at least 8 MiB each: more than the 64.0 GiB this machine has available (use a few workers per loader (2 to 8 "
        "is usual; 0 loads in the training process))"
    ]


def test_a_gpu_run_larger_than_its_gpu_is_refused_before_its_batches_are_built():
    """On a GPU the run only took minutes building batches of 10 million sequences before it
    failed; the plan is held against the whole memory of the process's GPU (given here: the
    check reads the current CUDA device's where one is)."""
    from megatron_bridge.config.errors import ConfigValidationError
    from megatron_bridge.training.memory_fit import refuse_what_the_gpu_cannot_hold
    from recipes import tiny_gpt_pretrain_config

    cfg = tiny_gpt_pretrain_config()
    process_config_with_overrides(cfg, cli_overrides=["train.micro_batch_size=1000", "train.global_batch_size=1000"])
    runtime_config_update(cfg, world_size=1)
    worst = plan(cfg, with_fixes=False).worst
    needed = int(worst.state.params + worst.state.grads + worst.state.optimizer + worst.activations.total)
    refuse_what_the_gpu_cannot_hold(cfg, total=needed, gpu="NVIDIA H100 80GB HBM3")  # fits exactly
    with pytest.raises(ConfigValidationError) as err:
        refuse_what_the_gpu_cannot_hold(cfg, total=2**30, gpu="NVIDIA H100 80GB HBM3")
    (message,) = err.value.errors
    assert message.startswith(f"<config>: this run needs about {needed / 2**30:,.1f} GiB of GPU memory per process (parameters 0.00, ")
    assert message.endswith(
        "more than the 1.0 GiB of its GPU (NVIDIA H100 80GB HBM3) (`--plan-only` shows where it goes; make the model, "
        "train.micro_batch_size or model.seq_length smaller, or split the model over more GPUs "
        "(model.tensor_model_parallel_size, model.pipeline_model_parallel_size))"
    )



def test_a_planner_failure_leaves_the_memory_checks_to_the_run_with_a_warning(monkeypatch, caplog):
    """The checks only guard a run: a config the planner fails on trains unchecked, and says so."""
    from megatron_bridge.training import memory_fit
    from recipes import tiny_gpt_pretrain_config

    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    cfg = tiny_gpt_pretrain_config()
    runtime_config_update(cfg, world_size=1)
    monkeypatch.setattr(memory_fit, "plan", broken)
    with caplog.at_level(logging.WARNING, logger="megatron_bridge"):
        memory_fit.refuse_what_the_gpu_cannot_hold(cfg, total=1)
        memory_fit.refuse_what_host_memory_cannot_hold(cfg, available=2**40)
    assert caplog.text.count("the memory check could not plan this run (IndexError: list index out of range); it runs unchecked") == 2


def test_a_model_of_more_elements_than_a_float_holds_exactly_is_planned_not_crashed():
    """Bucket padding computed in floats came out smaller than the bucket past 2**53 elements, and
    the optimizer shards then indexed a data-parallel rank that does not exist (IndexError)."""
    from megatron_bridge.planning.buffers import _pad
    from recipes import tiny_gpt_pretrain_config

    n = 2**60 + 1
    assert _pad(n, 128) == 2**60 + 128 and _pad(2**20, 128) == 2**20
    cfg = tiny_gpt_pretrain_config()
    process_config_with_overrides(cfg, cli_overrides=["model.num_layers=10000", "model.hidden_size=10000000"])
    runtime_config_update(cfg, world_size=1)
    result = plan(cfg)
    assert not result.fits and result.worst.state.params > 2**60
