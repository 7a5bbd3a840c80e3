"""The planner's activation formula against what autograd really keeps, on CPU: the tensors one
megatron-core layer saves for backward (unfused and SDPA attention, selective recompute, LoRA and
DoRA adapters, OLMo 2's norms, multi-latent attention), and the peak of a whole forward and
backward pass of a small GPT. The bench config's plan is checked against its GPU measurement."""


import pytest
import torch
import torch.nn.functional as F
from factories import one_process_group, tiny_config, tiny_model
from megatron.core.transformer.enums import AttnBackend

from megatron_bridge.models import count_parameters
from megatron_bridge.peft import DoRA, LoRA
from megatron_bridge.planning import mtp
from megatron_bridge.planning.activations import layer_terms, stage_activations
from megatron_bridge.planning.adapters import local_adapted
from megatron_bridge.planning.inputs import PlanInputs
from megatron_bridge.planning.params import chunks
from megatron_bridge.training import cpu_backend
from megatron_bridge.training.config import (
    MockGPTDatasetConfig,
    TrainingConfig,
    ValidationConfig,
    runtime_config_update,
)

pytestmark = pytest.mark.timeout(300)
ON_CPU = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="measures on CPU with the CPU backend (off where CUDA is available); on a GPU the bench compares "
    "its measured peak with the plan",
)

SEQ = 256
LLAMA_LIKE = dict(
    num_layers=2, hidden_size=128, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=256,
    normalization="LayerNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
    hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope", seq_length=SEQ,
)  # fmt: skip
"""GQA, rotary, SwiGLU without the fused kernel, no dropout; LayerNorm, which keeps the same
tensors on CPU and GPU (torch's RMSNorm is fused on GPUs only)."""


@pytest.fixture(scope="module")
def megatron():
    """A one-process group, the CPU backend and megatron-core's parallel state."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with one_process_group(), cpu_backend.active():
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


OLMO2_NORMS = dict(
    normalization="RMSNorm", input_layernorms=False, output_layernorms=True, qk_layernorm=True,
    qk_layernorm_per_head=False,
)  # fmt: skip
"""OLMo 2's layer: no norms before attention and MLP, RMSNorms after them, qk-norm over the whole
projections (`ProjectionNorm`)."""


def resolved(tmp_path, vocab=512, peft=None, precision="bf16_mixed", provider=tiny_model, base=LLAMA_LIKE, **fields):
    model = provider(**{**base, **fields}, vocab_size=vocab)
    cfg = tiny_config(
        model=model,
        train=TrainingConfig(train_iters=1, global_batch_size=1, micro_batch_size=1),
        dataset=MockGPTDatasetConfig(seq_length=SEQ, num_workers=0),
        validation=ValidationConfig(eval_iters=0),
    )
    cfg.tokenizer.vocab_size = vocab
    cfg.mixed_precision = precision
    if peft is not None:
        cfg.peft = peft
        cfg.checkpoint.pretrained_checkpoint = str(tmp_path)  # never read: the model is built here
    runtime_config_update(cfg, world_size=1, device="cpu")
    return cfg


def build(cfg):
    """The model `provide()` builds, adapted when the config has PEFT, in bf16 like Float16Module
    (in fp32 without mixed precision)."""
    model = cfg.model.provide(pre_process=True, post_process=True)
    if cfg.peft is not None:
        from megatron_bridge.peft.apply import apply_peft

        apply_peft(model, cfg.peft)
    return model.bfloat16() if cfg.mixed_precision else model


def storage_recorder(excluded: set) -> tuple[dict, object]:
    """({storage pointer: bytes}, a saved-tensors pack hook that fills it with the storages of
    the tensors autograd saves, those in `excluded` (parameters) left out)."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    return saved, pack


def saved_by_layer(model, layer=0):
    """Bytes of the distinct storages the layer's forward saves for backward (parameters left out)."""
    saved, pack = storage_recorder({p.untyped_storage().data_ptr() for p in model.parameters()})
    dtype = next(model.parameters()).dtype
    hidden = torch.randn(SEQ, 1, model.config.hidden_size, dtype=dtype, requires_grad=True)
    rotary = model.rotary_pos_emb(SEQ) if hasattr(model, "rotary_pos_emb") else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # no mask: causal, as in training
        model.decoder.layers[layer](hidden, attention_mask=None, rotary_pos_emb=rotary)
    return sum(saved.values())


def saved_by(module, dtype, width):
    """Bytes of the distinct storages `module` saves for backward on a [SEQ, 1, width] input."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(SEQ, 1, width, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(saved.values())


def cpu_rms_norm_surplus(model, layer=0):
    """What torch's RMSNorm keeps on CPU beyond what its fused GPU kernel keeps (the input and one
    fp32 1/rms per token), which the planner plans: on CPU it is a composite of fp32 ops that keeps
    fp32 copies instead. Summed over the layer's RMSNorm modules of torch (output norms, MLA's
    latent norms), each measured on its own at its width."""
    dtype = next(model.parameters()).dtype
    norms = [m for m in model.decoder.layers[layer].modules() if isinstance(m, torch.nn.RMSNorm)]
    surplus = 0
    for norm in norms:
        width = norm.normalized_shape[0]
        surplus += saved_by(norm, dtype, width) - (dtype.itemsize * SEQ * width + 4 * SEQ)
    return surplus


def planned_layer(cfg, layer=0):
    inp = PlanInputs.from_config(cfg)
    terms = layer_terms(inp, False, None, inp.attention_masks[layer], local_adapted(inp, layer))
    return sum(terms.values()), terms, inp


LAYER_CASES = {
    "unfused": dict(attention_backend=AttnBackend.unfused),
    "unfused, selective recompute": dict(attention_backend=AttnBackend.unfused, recompute_granularity="selective"),
    "SDPA": dict(attention_backend=AttnBackend.auto),
    "unfused, MHA, GeLU, no rotary": dict(
        attention_backend=AttnBackend.unfused, num_query_groups=None, gated_linear_unit=False,
        activation_func=F.gelu, position_embedding_type="learned_absolute",
    ),  # fmt: skip
    "LoRA on SDPA": dict(attention_backend=AttnBackend.auto, peft=LoRA(dim=8)),
    "DoRA on unfused": dict(
        attention_backend=AttnBackend.unfused, peft=DoRA(dim=4, target_modules=["linear_qkv", "linear_fc2"])
    ),
    "OLMo 2 norms, unfused": dict(attention_backend=AttnBackend.unfused, **OLMO2_NORMS),
    "OLMo 2 norms, fp32, unfused, selective recompute of norms": dict(
        attention_backend=AttnBackend.unfused, precision=None, recompute_granularity="selective",
        recompute_modules=["core_attn", "layernorm"], **OLMO2_NORMS,
    ),  # fmt: skip
    "OLMo 2 norms, LoRA on SDPA": dict(attention_backend=AttnBackend.auto, peft=LoRA(dim=8), **OLMO2_NORMS),
}


@ON_CPU
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_terms_equal_what_autograd_saves(megatron, tmp_path, case):
    """Every tensor a megatron-core layer keeps for backward is one of the planner's terms, and
    their sum equals the distinct storages autograd saves (the attention mask, built once per
    step and shared by the layers, and parameters are not activations)."""
    cfg = resolved(tmp_path, **LAYER_CASES[case])
    model = build(cfg)
    planned, terms, inp = planned_layer(cfg)
    assert inp.core_attention == ("sdpa" if "SDPA" in case else "unfused")
    measured = saved_by_layer(model) - cpu_rms_norm_surplus(model)  # the planner plans the GPU's fused RMSNorm
    # within 0.2%: torch's CPU LayerNorm keeps its statistics in bf16 (GPUs: fp32), and the
    # recompute checkpoint keeps a 4-byte scalar
    assert measured == pytest.approx(planned, rel=2e-3), terms
    if "LoRA" in case or "DoRA" in case:
        assert any(k.startswith("adapter rank-r") for k in terms)
    if "selective" in case:
        assert not any("softmax" in k for k in terms)
    elif case.startswith("unfused"):
        assert terms["attention softmax output (fp32)"] == 4 * 8 * SEQ * SEQ
    if "OLMo 2" in case:  # the layer's own norms: none before attention and MLP, after both, over Q and K
        assert not any(k.startswith(("attention norm", "MLP norm")) for k in terms), terms
        kept_input = inp.activation_bytes * SEQ * 128  # the [SEQ, 1, hidden] output of linear_proj / linear_fc2
        assert terms["attention output norm input"] == terms["MLP output norm input"] == kept_input
        assert terms["Q, K norm statistics (fp32 per token)"] == 2 * 4 * SEQ


MLA_LAYER = dict(
    num_layers=2, hidden_size=128, num_attention_heads=8, ffn_hidden_size=256, seq_length=SEQ, num_moe_experts=None,
    moe_layer_freq=1, moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None, hidden_dropout=0.0,
    attention_dropout=0.0, attention_backend=AttnBackend.unfused,
)  # fmt: skip
"""A dense DeepSeek-V3 layer (`factories.tiny_deepseek_model`): multi-latent attention, RMSNorm."""

LATENT_PROJECTIONS = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj"]

MLA_CASES = {
    "low-rank queries": {},
    "full query projection, fp32": dict(q_lora_rank=None, precision=None),
    "selective recompute of core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    # adapted layers keep their inputs, frozen ones none: here the layer input and both norm outputs
    "LoRA on every projection": dict(peft=LoRA(dim=8, target_modules=[*LATENT_PROJECTIONS, "linear_proj"])),
    # frozen up projections: the latent norms' outputs are not kept
    "LoRA on the down projections": dict(
        peft=LoRA(dim=8, target_modules=["linear_q_down_proj", "linear_kv_down_proj"])
    ),
    "DoRA on the up and output projections, full query projection": dict(
        q_lora_rank=None, peft=DoRA(dim=4, target_modules=["linear_q_proj", "linear_kv_up_proj", "linear_proj"])
    ),
    # input dropout: the adapters keep dropped copies, not the inputs themselves
    "LoRA with input dropout, fp32": dict(
        precision=None, peft=LoRA(dim=4, dropout=0.1, target_modules=["linear_q_down_proj", "linear_kv_up_proj"])
    ),
}


@ON_CPU
@pytest.mark.parametrize("case", list(MLA_CASES))
def test_latent_attention_layer_terms_equal_what_autograd_saves(megatron, tmp_path, case):
    """Multi-latent attention on local layers: the latents, their norms, the rotary tables, the
    up-projected Q, K, V and the core attention's tensors are what autograd saves."""
    from factories import tiny_deepseek_model

    cfg = resolved(tmp_path, provider=tiny_deepseek_model, base=MLA_LAYER, **MLA_CASES[case])
    model = build(cfg)
    planned, terms, inp = planned_layer(cfg)
    assert inp.mla and inp.core_attention == "unfused"
    measured = saved_by_layer(model) - cpu_rms_norm_surplus(model)
    if cfg.mixed_precision:
        # the fused GPU norm keeps its input, a view of the key/value down projection's output with
        # the rope part; torch's CPU composite keeps an fp32 copy of the latent part instead
        measured += inp.activation_bytes * SEQ * inp.qk_rope_dim
    measured -= cpu_dropout_mask_surplus(model, inp.activation_bytes) if inp.peft_dropout else 0
    assert measured == pytest.approx(planned, rel=2e-3), terms
    if cfg.peft is not None:  # without recompute, to the byte (DoRA's per-feature ratios and norms too)
        assert measured == planned, terms
    assert ("Q, K, V" in terms) and ("attention softmax output (fp32)" in terms) == ("selective" not in case)
    assert ("adapter rank-r intermediates (A x)" in terms) == (cfg.peft is not None)


def cpu_dropout_mask_surplus(model, element_bytes):
    """What the adapters' input dropout keeps on CPU beyond the GPU kernel's one-byte mask per
    element: torch's CPU dropout keeps its scaled mask in the input's dtype."""
    from megatron_bridge.peft.apply import adapters

    widths = [a.base_layer.weight.shape[1] for a in adapters(model.decoder.layers[0])]  # column-parallel inputs
    return (element_bytes - 1) * SEQ * sum(widths)


@ON_CPU
@pytest.mark.parametrize(
    "model_fields, peft",
    [
        (dict(), LoRA(dim=8, target_modules=[*LATENT_PROJECTIONS, "linear_proj", "*.experts.*.linear_fc1"])),
        (dict(q_lora_rank=None), DoRA(dim=4, target_modules=["linear_q_proj", "linear_kv_down_proj", "linear_proj"])),
    ],
    ids=["LoRA, low-rank queries, experts", "DoRA, full query projection"],
)
def test_planned_parameters_of_adapted_latent_attention_are_the_models(megatron, tmp_path, model_fields, peft):
    """The planner's parameter list of a multi-latent attention model with adapters (a dense and a
    mixture-of-experts layer) is the adapted model's: names, sizes, and which train."""
    from factories import tiny_deepseek_model

    from megatron_bridge.peft.apply import trainable_counts
    from megatron_bridge.planning.params import chunk_params

    cfg = resolved(tmp_path, provider=tiny_deepseek_model, base=dict(seq_length=SEQ), peft=peft, **model_fields)
    model = build(cfg)
    inp = PlanInputs.from_config(cfg)
    planned = [(p.name, p.numel, p.trainable) for c in chunks(inp)[0] for p in chunk_params(inp, c)]
    assert planned == [(n, p.numel(), p.requires_grad) for n, p in model.named_parameters()]
    trainable, total = trainable_counts(model)
    assert sum(k for _, k, trains in planned if trains) == trainable
    assert 0 < trainable < total / 5


def peak_of_a_step(model, vocab):
    """Peak bytes allocated (beyond what existed before) during one forward and backward pass of
    `model` under megatron-core's DDP (gradient buffers allocated beforehand, so the weight
    gradients go into them as on a GPU), from the profiler's record of every CPU allocation."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    config = model.config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, model))
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, vocab, (1, SEQ), generator=g) for _ in range(2))
    positions = torch.arange(SEQ)[None]
    # The score buffer is allocated at first use and kept: drop the one an earlier test made.
    from megatron.core import parallel_state

    parallel_state.get_global_memory_buffer().buffer.clear()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = ddp(tokens, positions, None, labels=labels)  # no mask: causal, as in training
        loss.sum().backward()
        del loss
    # megatron-core adds the prediction depths' losses to a process-wide tracker: leave it empty
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    events = []

    def walk(nodes):
        for node in nodes:
            if node.tag == _EventType.Allocation:
                events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    live, now, peak = {}, 0, 0
    for _, ptr, size in sorted(events):
        if size > 0:
            live[ptr] = size
            now += size
        elif ptr in live:
            now -= live.pop(ptr)
        peak = max(peak, now)
    return peak


@ON_CPU
@pytest.mark.parametrize(
    "fields, vocab, moment",
    [
        (
            dict(attention_backend=AttnBackend.unfused, recompute_granularity="selective"),
            1024,
            "core attention backward",
        ),
        (dict(attention_backend=AttnBackend.unfused), 1024, "core attention backward"),
        (dict(attention_backend=AttnBackend.auto), 4096, "cross entropy"),
        # the losses of two prediction depths, computed in the forward pass, keep their softmax
        (dict(attention_backend=AttnBackend.auto, mtp_num_layers=2), 4096, "cross entropy"),
        # the depths' tensors are freed before the decoder's last layer runs its backward
        (
            dict(attention_backend=AttnBackend.unfused, recompute_granularity="selective", mtp_num_layers=1),
            1024,
            "core attention backward",
        ),
    ],
    ids=["unfused, selective", "unfused", "SDPA", "SDPA, two MTP depths", "unfused, selective, one MTP depth"],
)
def test_peak_of_a_training_step_matches_the_plan(megatron, tmp_path, fields, vocab, moment):
    """The planned activation peak (saved tensors of every layer, the working set of the
    largest transient moment, the score buffer) against the measured peak of a step."""
    cfg = resolved(tmp_path, vocab=vocab, **fields)
    model = build(cfg)
    inp = PlanInputs.from_config(cfg)
    act = stage_activations(inp, chunks(inp)[0])
    assert act.moment.startswith(moment), act
    measured = peak_of_a_step(model, vocab)
    print(f"measured {measured}, planned {act.total:.0f}, ratio {measured / act.total:.4f}")
    assert measured == pytest.approx(act.total, rel=0.04), (measured, act)


@ON_CPU
def test_selective_recompute_trains_on_cpu_as_without_it(megatron, tmp_path):
    """Recompute saves and restores RNG state and builds masks in the backward pass: both work
    on CPU, and the gradients are those of the plain layer."""
    grads = []
    for recompute in (None, "selective"):
        cfg = resolved(tmp_path, attention_backend=AttnBackend.unfused, recompute_granularity=recompute)
        torch.manual_seed(0)
        model = build(cfg)
        g = torch.Generator().manual_seed(1)
        hidden = torch.randn(SEQ, 1, 128, dtype=torch.bfloat16, requires_grad=True, generator=g)
        out, _ = model.decoder.layers[0](hidden, attention_mask=None, rotary_pos_emb=model.rotary_pos_emb(SEQ))
        out.float().square().sum().backward()
        grads.append(hidden.grad.float())
    assert torch.equal(grads[0], grads[1])


MEASURED_BENCH_PEAK = 39_700_852_736
"""torch.cuda.max_memory_allocated of tools/bench_gpu.py's shape on one H200 (bf16, megatron-core
0.16.1 local layers with unfused attention and selective recompute, no TransformerEngine): the
same in pretrain() and the hand-written loop (docs: gpu-check)."""


def test_plan_of_the_gpu_bench_config_is_within_10_percent_of_its_measured_peak():
    import sys
    from pathlib import Path

    from megatron_bridge.planning import plan

    sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
    from bench_gpu import GPU_SHAPE, bench_config

    cfg = bench_config(GPU_SHAPE, "unfused", iters=6, te=False, cuda=True)
    runtime_config_update(cfg, world_size=1)
    p = plan(cfg, gpu="h200-141gb", with_fixes=False)
    (rank,) = p.ranks
    planned = rank.total - rank.workspace  # the allocator does not see the fixed allowance
    assert (p.inputs.transformer_engine, p.inputs.core_attention) == (False, "unfused")
    assert rank.activations.moment == "core attention backward of the last layer"
    # the three fp32 score planes of one layer's softmax backward (1 x 32 heads x 4096 x 4096)
    assert rank.activations.working["attention score planes in the core attention's backward"] == 3 * 4 * 32 * 4096**2
    assert 0.9 <= MEASURED_BENCH_PEAK / planned <= 1.1, planned


# ---------------------------------------------------------------------- multi-token prediction
def saved_by_mtp_depth(model, depth=0):
    """Bytes of the distinct storages one multi-token prediction depth saves for backward, less
    its hidden-state input (the storage the preceding output layer keeps, planned there) and the
    rotary frequencies (computed once per step; a recompute checkpoint keeps a reference)."""
    rotary = model.rotary_pos_emb(SEQ) if hasattr(model, "rotary_pos_emb") else None
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if rotary is not None:
        params.add(rotary.untyped_storage().data_ptr())
    saved, pack = storage_recorder(params)
    dtype = next(model.parameters()).dtype
    hidden = torch.randn(SEQ, 1, model.config.hidden_size, dtype=dtype, requires_grad=True)
    tokens, positions = torch.randint(0, 256, (1, SEQ)), torch.arange(SEQ)[None]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.mtp.layers[depth](
            input_ids=tokens, position_ids=positions, hidden_states=hidden, attention_mask=None,
            rotary_pos_emb=rotary, embedding=model.embedding,
        )  # fmt: skip
    return sum(saved.values()) - saved.get(hidden.untyped_storage().data_ptr(), 0)


MTP_CASES = {
    "dense, unfused": dict(attention_backend=AttnBackend.unfused),
    "dense, SDPA, selective recompute of the MLP": dict(
        attention_backend=AttnBackend.auto, recompute_granularity="selective", recompute_modules=["mlp"]
    ),
    "dense, fp32, full uniform recompute": dict(
        attention_backend=AttnBackend.unfused, precision=None, recompute_granularity="full",
        recompute_method="uniform", recompute_num_layers=1,
    ),  # fmt: skip
}


@ON_CPU
@pytest.mark.parametrize("case", list(MTP_CASES))
def test_multi_token_prediction_depth_terms_equal_what_autograd_saves(megatron, tmp_path, case):
    """A multi-token prediction depth on local layers keeps the next tokens' ids and embedding,
    the norms' statistics, the projection's input, a transformer layer's tensors and its final
    norm's input: what autograd saves (the output layer input and the loss are measured in the
    peak of a step below)."""
    cfg = resolved(tmp_path, mtp_num_layers=1, **MTP_CASES[case])
    model = build(cfg)
    model.train()
    inp = PlanInputs.from_config(cfg)
    assert inp.mtp_depths == 1
    terms = mtp.mtp_depth_terms(inp, 0)
    after = (*mtp.MTP_LOSS, *mtp.MTP_OUTPUT_INPUTS)  # kept by the output layers and losses
    planned = sum(v for k, v in terms.items() if k not in after)
    measured = saved_by_mtp_depth(model)
    print(f"{case}: measured {measured}, planned {planned:.0f}")
    if cfg.mixed_precision:  # torch's CPU LayerNorm keeps mean and 1/std in bf16 (4 bytes a token; GPUs: 8)
        norms = sum(isinstance(m, torch.nn.LayerNorm) for m in model.mtp.layers[0].modules())
        measured += 4 * SEQ * norms
    assert measured == planned, terms
    # the parameter count (FLOPs, preflight) has the depths' parameters too
    assert count_parameters(cfg.model).total == sum(p.numel() for p in model.parameters())
    layer = {k.removeprefix("MTP layer: "): v for k, v in terms.items() if k.startswith("MTP layer: ")}
    # a decoder layer's tensors; with full recompute the checkpoint keeps the embedding only
    assert layer == ({} if "full" in case else layer_terms(inp, False, None, False))
