"""Effects of the model, parallelism, precision and seed settings: each non-default value changes
the megatron-core object built from the config (the GPTModel, its config, the DDP wrapper, the
optimizer, the parallel state, the RNG tracker) or a library call the run makes.

Settings that only act on GPUs, with NCCL or with TransformerEngine are shown reaching the
megatron-core config or the call that would use them; each test says which."""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types

import pytest
import torch
from factories import on_cpu, one_process_group, tiny_config, tiny_model

from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.config.targets import register_target
from megatron_bridge.training.comm_overlap import CommOverlapConfig
from megatron_bridge.training.config import runtime_config_update
from megatron_bridge.training.mixed_precision import MixedPrecisionConfig

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group for the module (runs set up inside it reuse it)."""
    with one_process_group():
        yield


@contextlib.contextmanager
def model_parallel_state():
    """megatron-core's parallel state for building a model: the live run's if one is set up."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def build_gpt(**settings):
    provider = tiny_model(vocab_size=300, use_cpu_initialization=True, **settings)
    provider.finalize()
    with model_parallel_state():
        return provider.provide(pre_process=True, post_process=True)


# ---------------------------------------------------------------------- GPTModel arguments
def test_gpt_fields_reach_the_gpt_model(process_group):
    """`provide()` (what the run's model build calls) hands these to megatron-core's GPTModel."""
    default = build_gpt()
    changed = build_gpt(
        fp16_lm_cross_entropy=True,
        parallel_output=False,
        rotary_percent=0.5,
        seq_len_interpolation_factor=4.0,
        should_pad_vocab=False,
        scatter_embedding_sequence_parallel=False,
    )
    # fp16_lm_cross_entropy: the loss is taken on fp16 logits instead of upcasting them.
    assert (default.fp16_lm_cross_entropy, changed.fp16_lm_cross_entropy) == (False, True)
    # parallel_output: logits are gathered over tensor-parallel ranks instead of staying split.
    assert (default.parallel_output, changed.parallel_output) == (True, False)
    # rotary_percent: RoPE rotates half of each head's 16 dimensions (4 frequencies, not 8).
    assert default.rotary_pos_emb.inv_freq.numel() == 8 and changed.rotary_pos_emb.inv_freq.numel() == 4
    # seq_len_interpolation_factor: position 8 is rotated as position 8 / 4 = 2.
    angles = changed.rotary_pos_emb.get_freqs_non_repeated(32)
    assert torch.allclose(angles[8], 2 * changed.rotary_pos_emb.inv_freq)
    assert torch.allclose(default.rotary_pos_emb.get_freqs_non_repeated(32)[8], 8 * default.rotary_pos_emb.inv_freq)
    # should_pad_vocab: 300 embedding rows instead of 300 padded to a multiple of 128.
    assert default.embedding.word_embeddings.weight.shape[0] == 384
    assert changed.embedding.word_embeddings.weight.shape[0] == 300
    # scatter_embedding_sequence_parallel: the embedding output is not split over the sequence
    # (megatron-core does so only with sequence parallelism, which needs TP > 1).
    assert default.embedding.scatter_to_sequence_parallel is True
    assert changed.embedding.scatter_to_sequence_parallel is False


class TorchRMSNorm:
    """torch's RMSNorm built the way megatron-core builds a norm of a layer spec."""

    def __new__(cls, config, hidden_size, eps=1e-5, **unused):
        return torch.nn.RMSNorm(hidden_size, eps=eps)


def rms_norm_layers(provider, vp_stage=None):
    """megatron-core's local layers with RMSNorm, whatever the provider's normalization."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer = get_gpt_layer_local_spec()
    layer.submodules = dataclasses.replace(layer.submodules, input_layernorm=TorchRMSNorm, pre_mlp_layernorm=TorchRMSNorm)
    return layer


def test_transformer_layer_spec_decides_the_layers(process_group):
    """A callable `transformer_layer_spec` replaces megatron-core's default layer spec."""
    default = build_gpt()
    changed = build_gpt(transformer_layer_spec=rms_norm_layers)
    assert default.config.normalization == changed.config.normalization == "LayerNorm"
    assert type(default.decoder.layers[0].input_layernorm) is torch.nn.LayerNorm
    assert type(changed.decoder.layers[0].input_layernorm) is torch.nn.RMSNorm
    assert type(changed.decoder.layers[1].pre_mlp_layernorm) is torch.nn.RMSNorm


def test_qk_l2_norm_normalizes_queries_and_keys(process_group):
    """`qk_l2_norm` reaches megatron-core's decoder spec: queries and keys are L2-normalized per head."""
    from megatron.core.transformer.torch_norm import L2Norm

    default, changed = build_gpt(), build_gpt(qk_l2_norm=True)
    attention = changed.decoder.layers[0].self_attention
    assert type(attention.q_layernorm) is type(attention.k_layernorm) is L2Norm
    assert type(default.decoder.layers[0].self_attention.q_layernorm) is not L2Norm


# ---------------------------------------------------------------------- comm_overlap and precision presets
def test_comm_overlap_fields_reach_the_model_ddp_and_optimizer_configs():
    """These act with pipeline parallelism, several data-parallel ranks and (the deferred
    embedding gradient) the fused gradient-accumulation kernel, i.e. on GPUs: shown reaching the
    megatron-core configs the run builds its model, DDP wrapper and optimizer from."""
    layout = dict(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    model = tiny_model(**layout, gradient_accumulation_fusion=True)  # a CUDA kernel
    overlap = CommOverlapConfig(
        align_param_gather=False,  # the layout's default here is on (VP > 1 with DP overlap)
        defer_embedding_wgrad_compute=True,
        wgrad_deferral_limit=3,
        overlap_param_gather_with_optimizer_step=True,
    )
    cfg = tiny_config(model=model, comm_overlap=overlap)
    cfg.ddp.use_distributed_optimizer = True
    runtime_config_update(cfg, world_size=4)
    assert cfg.ddp.overlap_param_gather is True  # DP = 2 with the distributed optimizer
    assert cfg.ddp.align_param_gather is False
    assert cfg.model.defer_embedding_wgrad_compute is True and cfg.model.wgrad_deferral_limit == 3
    assert cfg.optimizer.overlap_param_gather_with_optimizer_step is True

    laid_out = tiny_config(model=tiny_model(**layout), comm_overlap=CommOverlapConfig())
    laid_out.ddp.use_distributed_optimizer = True
    runtime_config_update(laid_out, world_size=4)
    assert laid_out.ddp.align_param_gather is True
    assert laid_out.model.defer_embedding_wgrad_compute is False
    assert laid_out.optimizer.overlap_param_gather_with_optimizer_step is False


def test_param_gather_with_optimizer_step_needs_interleaved_pipelining():
    """megatron-core splits the first model chunk off for it and fails (IndexError) with one chunk."""
    cfg = tiny_config(comm_overlap=CommOverlapConfig(overlap_param_gather_with_optimizer_step=True))
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg, world_size=1)
    assert err.value.errors == [
        "optimizer.overlap_param_gather_with_optimizer_step: needs ddp.use_distributed_optimizer=True, "
        "ddp.overlap_param_gather=True, model.virtual_pipeline_model_parallel_size > 1 "
        "(set those too, or turn overlap_param_gather_with_optimizer_step off)"
    ]


def test_fp8_and_fp4_preset_fields_reach_the_model_config():
    """FP8/FP4 run in TransformerEngine on GPUs: the preset's fields reach the model's
    TransformerConfig (which megatron-core's TE layers read), only when the preset uses FP8/FP4."""
    fp8_fields = {
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 1,
        "fp8_amax_history_len": 16,
        "fp8_amax_compute_algo": "max",
        "fp8_wgrad": False,
        "fp8_dot_product_attention": True,
        "fp8_multi_head_attention": True,
    }
    cfg = tiny_config(mixed_precision=MixedPrecisionConfig(bf16=True, fp8="hybrid", **fp8_fields))
    runtime_config_update(cfg, world_size=1)
    assert {name: getattr(cfg.model, name) for name in fp8_fields} == fp8_fields

    without_fp8 = tiny_config(mixed_precision=MixedPrecisionConfig(bf16=True, **fp8_fields))
    runtime_config_update(without_fp8, world_size=1)
    assert {name: getattr(without_fp8.model, name) for name in fp8_fields} != fp8_fields

    # fp4_recipe='custom': the model's fp4_quantizer_factory supplies the quantizers. megatron-core
    # imports that path and calls it, so only a factory registered from code may be named.
    register_target(custom_quantizers)
    model = tiny_model(fp4_quantizer_factory=f"{__name__}.custom_quantizers")
    cfg = tiny_config(model=model, mixed_precision=MixedPrecisionConfig(bf16=True, fp4="e2m1", fp4_recipe="custom"))
    runtime_config_update(cfg, world_size=1)
    assert (cfg.model.fp4, cfg.model.fp4_recipe) == ("e2m1", "custom")
    assert tiny_model().fp4_recipe == "nvfp4"
    for name in ("fp4_quantizer_factory", "fp8_quantizer_factory"):
        cfg = tiny_config(model=tiny_model(**{name: "os.system"}))
        with pytest.raises(ConfigValidationError) as err:
            runtime_config_update(cfg, world_size=1)
        assert err.value.errors == [
            f"model.{name}: 'os.system' is not a name configs may use (megatron-core would import and call it) "
            "(configs may only name registered classes and functions; register yours in code with "
            "megatron_bridge.config.targets.register_target(obj))"
        ]


def custom_quantizers(*args):
    """A custom-recipe quantizer factory (never called here: FP4 needs TransformerEngine)."""
    return None


# ---------------------------------------------------------------------- TransformerEngine userbuffers
@pytest.fixture
def stand_in_transformer_engine(monkeypatch):
    """TransformerEngine needs CUDA and is not installed here: a stand-in module records the
    userbuffer calls the run makes (the real ones build CUDA communicators)."""
    from megatron_bridge import extras

    calls = []
    base = types.ModuleType("transformer_engine.pytorch.module.base")
    base.initialize_ub = lambda **kwargs: calls.append(("initialize_ub", kwargs))
    base.destroy_ub = lambda: calls.append(("destroy_ub", {}))
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.module"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        monkeypatch.setitem(sys.modules, name, module)
    base.__spec__ = importlib.machinery.ModuleSpec(base.__name__, None)
    monkeypatch.setitem(sys.modules, base.__name__, base)
    extras.is_installed.cache_clear()
    yield calls
    extras.is_installed.cache_clear()


def test_tp_comm_overlap_settings_reach_transformer_engines_userbuffers(stand_in_transformer_engine, tmp_path):
    from megatron_bridge.training.comm_overlap import destroy_tp_communicators, initialize_tp_communicators

    calls = stand_in_transformer_engine
    settings = tmp_path / "ub.yaml"
    settings.write_text("qkv_fprop:\n  method: ring_exchange\n  num_sm: 4\n")
    model = tiny_model(tensor_model_parallel_size=2, sequence_parallel=True, transformer_impl="transformer_engine")
    overlap = CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=str(settings), tp_comm_bootstrap_backend="gloo")
    cfg = tiny_config(model=model, comm_overlap=overlap)
    runtime_config_update(cfg, world_size=2)
    assert cfg.model.tp_comm_overlap is True
    assert initialize_tp_communicators(cfg.model, cfg.train.micro_batch_size)
    destroy_tp_communicators()
    assert calls == [
        (
            "initialize_ub",
            dict(
                shape=[32 * 2, 64],  # seq_length x micro_batch_size tokens of hidden_size
                tp_size=2,
                use_fp8=False,
                ub_cfgs={"qkv_fprop": {"method": "ring_exchange", "num_sm": 4}},
                bootstrap_backend="gloo",
            ),
        ),
        ("destroy_ub", {}),
    ]

    # Set on the model itself (GPTModelProvider.tp_comm_overlap_cfg), as a mapping.
    calls.clear()
    direct = tiny_model(tensor_model_parallel_size=2, transformer_impl="transformer_engine", tp_comm_overlap=True)
    direct.tp_comm_overlap_cfg = {"proj_fprop": {"method": "pipeline"}}
    assert initialize_tp_communicators(direct, 1)
    assert calls[0][1]["ub_cfgs"] == {"proj_fprop": {"method": "pipeline"}}
    assert calls[0][1]["bootstrap_backend"] == "nccl"  # megatron-core's default

    # megatron-core's local layers do not overlap: no userbuffers.
    calls.clear()
    assert not initialize_tp_communicators(tiny_model(tp_comm_overlap=True, transformer_impl="local"), 1)
    assert calls == []


# ---------------------------------------------------------------------- process groups and devices
def test_cuda_device_follows_local_rank_unless_mapped_externally(monkeypatch):
    """Which GPU `init_process_group` selects (torch.cuda.set_device) on a GPU run."""
    from megatron_bridge.training.config import DistributedInitConfig
    from megatron_bridge.runtime.distributed import cuda_device_index

    monkeypatch.setenv("LOCAL_RANK", "5")
    assert cuda_device_index(DistributedInitConfig()) == 5
    assert cuda_device_index(DistributedInitConfig(local_rank=3)) == 3
    assert cuda_device_index(DistributedInitConfig(local_rank=3, external_gpu_device_mapping=True)) == 0


def test_nccl_settings_reach_megatron_core_and_are_refused_on_cpu(monkeypatch, tmp_path):
    """SHARP, high-priority streams and NCCL communicator settings apply to NCCL groups (GPUs):
    megatron-core's group setup receives them (its call is recorded here, not made: with gloo it
    fails), and a CPU run refuses them before starting."""
    from megatron.core import parallel_state

    from megatron_bridge.runtime.distributed import init_model_parallel
    from megatron_bridge.training.setup import resolve_config

    nccl_settings = tmp_path / "nccl.yaml"
    nccl_settings.write_text("dp:\n  max_ctas: 4\n")
    cfg = tiny_config()
    cfg.dist.distributed_backend = "gloo"  # refused on a CPU run, also where GPUs are visible
    cfg.dist.use_sharp = True
    cfg.dist.high_priority_stream_groups = ["dp"]
    cfg.dist.nccl_communicator_config_path = str(nccl_settings)
    received = {}
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda **kwargs: received.update(kwargs))
    init_model_parallel(cfg)
    assert received["use_sharp"] is True
    assert received["high_priority_stream_groups"] == ["dp"]
    assert received["nccl_communicator_config_path"] == str(nccl_settings)

    with pytest.raises(ConfigValidationError) as err:
        resolve_config(cfg)
    assert [e.split(":")[0] for e in err.value.errors] == [
        "dist.use_sharp",
        "dist.high_priority_stream_groups",
        "dist.nccl_communicator_config_path",
    ]


def test_rank_seed_differs_across_data_parallel_ranks_only_when_asked():
    """With `data_parallel_random_init` each data-parallel replica seeds (and so initializes its
    weights) differently; `test_built_run_wiring` shows the broadcast that evens them out is
    skipped."""
    from megatron_bridge.training.config import RNGConfig
    from megatron_bridge.training.setup import rank_seed

    shared, own = RNGConfig(seed=7), RNGConfig(seed=7, data_parallel_random_init=True)
    assert rank_seed(shared, 0, 0) == rank_seed(shared, 0, 1) == 7
    assert rank_seed(own, 0, 0) == 7 and rank_seed(own, 0, 1) == 17
    assert rank_seed(shared, 1, 0) == 107


# ---------------------------------------------------------------------- a run set up with unusual settings
@pytest.fixture(scope="module")
def built(process_group):
    """`setup()` of a tiny fp16 run with the distributed optimizer, overlapped gradient reduce
    and parameter gather, and non-default process-group and RNG settings. Records the arguments
    of megatron-core's parallel-state and seed calls (both still run) and counts DDP's weight
    broadcasts. Torn down as a run is."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel

    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.runner import _shutdown
    from megatron_bridge.training.setup import setup

    precision = MixedPrecisionConfig(
        fp16=True, params_dtype=torch.half, min_loss_scale=8.0, loss_scale_window=7, hysteresis=3
    )
    overlap = CommOverlapConfig(overlap_grad_reduce=True, overlap_param_gather=True, align_param_gather=True)
    # a CPU run on every machine: it is set up in the module's gloo group
    cfg = on_cpu(tiny_config(mixed_precision=precision, comm_overlap=overlap))
    cfg.ddp.use_distributed_optimizer = True
    cfg.validation.eval_interval = None
    cfg.dist.align_grad_reduce = False
    cfg.dist.use_gloo_process_groups = False
    cfg.dist.use_tp_pp_dp_mapping = True
    cfg.rng.data_parallel_random_init = True
    cfg.rng.te_rng_tracker = True
    cfg.rng.inference_rng_tracker = True

    calls = {"broadcasts": 0}

    def recording(name, function):
        def record(*args, **kwargs):
            calls[name] = kwargs
            return function(*args, **kwargs)

        return record

    def counting_broadcast(self):
        calls["broadcasts"] += 1
        return broadcast(self)

    broadcast = DistributedDataParallel.broadcast_params
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel_state, "initialize_model_parallel", recording("parallel_state", parallel_state.initialize_model_parallel))
        seed = tensor_parallel.model_parallel_cuda_manual_seed
        patch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed", recording("seed", seed))
        patch.setattr(DistributedDataParallel, "broadcast_params", counting_broadcast)
        run = setup(cfg, forward_step)
    try:
        yield run, calls
    finally:
        _shutdown(run.state)


def test_fp16_loss_scaling_settings_reach_the_optimizer(built):
    """fp16 training scales the loss: the optimizer megatron-core builds gets a dynamic scaler
    with the preset's bounds, or a constant one with `loss_scale`."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    from megatron_bridge.training.build import build_optimizer

    run, _ = built
    precision = run.state.cfg.mixed_precision
    assert (precision.min_loss_scale, precision.loss_scale_window, precision.hysteresis) == (8.0, 7, 3)
    (scaler,) = grad_scalers(run.state.optimizer)
    assert isinstance(scaler, DynamicGradScaler)
    assert (scaler.min_scale.item(), scaler.growth_interval, scaler.hysteresis) == (8.0, 7, 3)

    static = tiny_config(mixed_precision=MixedPrecisionConfig(fp16=True, params_dtype=torch.half, loss_scale=1024.0))
    static.ddp.use_distributed_optimizer = True  # built over the live run's model and groups
    static.dist.use_gloo_process_groups = False
    runtime_config_update(static, world_size=1)
    optimizer, _ = build_optimizer(static, run.state.model, run.state)
    (scaler,) = grad_scalers(optimizer)
    assert isinstance(scaler, ConstantGradScaler) and scaler.scale.item() == 1024.0


def grad_scalers(optimizer):
    """The loss scalers of megatron-core's (possibly chained) optimizer, one per distinct scaler."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return list({id(p.grad_scaler): p.grad_scaler for p in parts}.values())


def test_built_run_wiring(built):
    """Gradient and parameter sync hooks, process groups, seeds and the weight broadcast."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    run, calls = built
    cfg = run.state.cfg
    config = run.state.model[0].config
    # align_grad_reduce=False: gradients are reduced per chunk as ready, not launched together by
    # the schedule (with overlap on, the default installs grad_sync_func).
    assert cfg.dist.align_grad_reduce is False and cfg.ddp.overlap_grad_reduce is True
    assert config.no_sync_func is not None and config.grad_sync_func is None
    # align_param_gather: the schedule launches the parameter all-gathers together.
    assert cfg.ddp.align_param_gather is True and config.param_sync_func is not None

    # use_gloo_process_groups=False: megatron-core makes no gloo copies of its groups.
    assert calls["parallel_state"]["create_gloo_process_groups"] is False
    with pytest.raises(AssertionError, match="not initialized"):
        parallel_state.get_data_parallel_group_gloo()
    # use_tp_pp_dp_mapping: pipeline ranks are adjacent, data-parallel ranks strided (shown for
    # 4 ranks with PP=2, DP=2 by megatron-core's own rank generator).
    order = calls["parallel_state"]["order"]
    assert order == "tp-cp-ep-pp-dp"
    layout = parallel_state.RankGenerator(tp=1, ep=1, dp=2, pp=2, cp=1, order=order)
    default = parallel_state.RankGenerator(tp=1, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    assert layout.get_ranks("dp") == [[0, 2], [1, 3]] and default.get_ranks("dp") == [[0, 1], [2, 3]]

    # inference_rng_tracker: megatron-core's inference tracker keeps no model-parallel streams.
    tracker = get_cuda_rng_tracker()
    assert type(tracker).__name__ == "InferenceCudaRNGStatesTracker" and tracker.get_states() == {}
    # te_rng_tracker asks megatron-core for TransformerEngine's tracker (GPU runs with TE; without
    # TE megatron-core keeps its own).
    assert calls["seed"]["te_rng_tracker"] is True and calls["seed"]["inference_rng_tracker"] is True
    # data_parallel_random_init: replicas keep their own initial weights (no broadcast).
    assert cfg.rng.data_parallel_random_init is True and calls["broadcasts"] == 0
