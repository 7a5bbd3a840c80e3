"""Mixed-precision presets and communication-overlap defaults."""

import logging

import pytest
import torch
from factories import tiny_config, tiny_model

from megatron_bridge.training.comm_overlap import DEFAULT_BUCKET_SIZE, CommOverlapConfig
from megatron_bridge.training.config import (
    ConfigValidationError,
    DistributedDataParallelConfig,
    OptimizerConfig,
    runtime_config_update,
)
from megatron_bridge.training.mixed_precision import PRESETS, MixedPrecisionConfig, get_mixed_precision_config


def test_bf16_preset_sets_model_optimizer_and_ddp():
    cfg = tiny_config(mixed_precision="bf16_mixed")
    runtime_config_update(cfg)
    assert cfg.model.bf16 and cfg.optimizer.bf16 and not cfg.model.fp16
    assert cfg.model.params_dtype == cfg.optimizer.params_dtype == torch.bfloat16
    assert cfg.model.pipeline_dtype == torch.bfloat16
    assert cfg.ddp.grad_reduce_in_fp32 is True
    assert isinstance(cfg.mixed_precision, MixedPrecisionConfig)
    assert not cfg.model.is_explicit("bf16")  # the preset's value, not the user's


def test_fp16_preset_sets_loss_scaling_on_the_optimizer():
    cfg = tiny_config(mixed_precision="fp16_mixed")
    runtime_config_update(cfg)
    assert cfg.model.fp16 and cfg.optimizer.fp16 and cfg.model.params_dtype == torch.half
    assert cfg.optimizer.initial_loss_scale == 4294967296.0 and cfg.ddp.grad_reduce_in_fp32 is False


@pytest.mark.parametrize("name", ["bf16-mixed", "BF16_MIXED", " bf16_mixed "])
def test_hyphen_and_case_spellings_resolve(name):
    assert get_mixed_precision_config(name).bf16


def test_the_registry_under_the_reference_systems_name():
    from megatron_bridge.training.mixed_precision import MIXED_PRECISION_RECIPES

    assert MIXED_PRECISION_RECIPES["fp16_mixed"]().fp16 and set(MIXED_PRECISION_RECIPES) == set(PRESETS)


def test_unknown_preset_lists_the_available_ones():
    cfg = tiny_config(mixed_precision="bf15_mixed")
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg)
    (message,) = err.value.errors
    assert message.startswith("mixed_precision: unknown preset 'bf15_mixed' (use one of: bf16_mixed, ")
    for name in PRESETS:
        assert name in message


@pytest.mark.parametrize(
    "name, fields",
    [
        ("bf16_with_fp8_delayed_scaling_mixed", dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_param=True)),
        ("bf16_with_fp8_current_scaling_mixed", dict(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True)),
        ("bf16_with_mxfp8_mixed", dict(fp8="e4m3", fp8_recipe="mxfp8", fp8_param=True)),
        ("bf16_with_fp8_subchannel_scaling_mixed", dict(fp8="hybrid", fp8_recipe="blockwise")),
        ("fp16_with_fp8_delayed_scaling_mixed", dict(fp16=True, fp8="hybrid", fp8_recipe="delayed")),
        ("bf16_with_nvfp4_mixed", dict(fp4="e2m1", fp4_recipe="nvfp4", fp8=None)),
    ],
)
def test_low_precision_presets_apply_their_fields_to_the_model(name, fields):
    mp = get_mixed_precision_config(name)
    model = tiny_model()
    from megatron_bridge.config.errors import Problems

    problems = Problems()
    mp.finalize()
    mp.apply(model, OptimizerConfig(lr=1e-3), None, problems, name)
    assert not problems
    for field, value in fields.items():
        assert getattr(model, field) == value, field


def test_fp8_fields_are_left_alone_by_a_non_fp8_preset():
    cfg = tiny_config(model=tiny_model(fp8_margin=3), mixed_precision="bf16_mixed")
    runtime_config_update(cfg)
    assert cfg.model.fp8_margin == 3 and cfg.model.fp8_recipe == "delayed"  # megatron-core's default, untouched


def test_preset_never_overwrites_an_explicit_user_value_and_reports_the_contradiction():
    model = tiny_model(params_dtype=torch.float32)  # explicit, equal to the default
    cfg = tiny_config(model=model, mixed_precision="bf16_mixed")
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg)
    assert err.value.errors == [
        "model.params_dtype: torch.float32 was set explicitly but mixed_precision 'bf16_mixed' sets torch.bfloat16 "
        "(remove the explicit model.params_dtype or choose another mixed_precision preset)"
    ]
    assert cfg.model.params_dtype == torch.float32


@pytest.mark.parametrize("preset, other", [("fp16_mixed", "bf16"), ("bf16_mixed", "fp16")])
def test_the_other_half_precision_set_by_the_user_contradicts_the_preset_by_name(preset, other):
    """A preset chooses its dtype as a whole: the user's explicit model.bf16=True under fp16_mixed
    was reported as "model.bf16 and model.fp16 are both on", without naming the preset."""
    cfg = tiny_config(model=tiny_model(**{other: True}), mixed_precision=preset)
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg)
    assert err.value.errors[0] == (
        f"model.{other}: True was set explicitly but mixed_precision {preset!r} sets False "
        f"(remove the explicit model.{other} or choose another mixed_precision preset)"
    )
    assert not any("are both on" in e for e in err.value.errors)


def test_user_values_where_the_preset_only_carries_a_default_stand():
    """fp16_mixed chooses fp16 and its dtypes, not the loss scaling: the user's static loss scale,
    or the dynamic scaler's hysteresis, on the optimizer are kept (megatron-core's --loss-scale,
    --hysteresis), not reported."""
    cfg = tiny_config(mixed_precision="fp16_mixed")
    cfg.optimizer.loss_scale = 128.0
    runtime_config_update(cfg)
    assert cfg.model.fp16 and cfg.optimizer.fp16
    assert cfg.optimizer.loss_scale == 128.0
    assert cfg.optimizer.min_loss_scale == 1.0  # not set by the user: the preset's

    dynamic = tiny_config(mixed_precision="fp16_mixed")
    dynamic.optimizer.hysteresis = 4
    runtime_config_update(dynamic)
    assert dynamic.optimizer.fp16 and dynamic.optimizer.loss_scale is None and dynamic.optimizer.hysteresis == 4

    chosen = tiny_config(mixed_precision="fp16_mixed")
    chosen.mixed_precision = get_mixed_precision_config("fp16_mixed")
    chosen.mixed_precision.hysteresis = 3  # now the preset's choice too: the user's 4 contradicts it
    chosen.optimizer.hysteresis = 4
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(chosen)
    assert err.value.errors == [
        "optimizer.hysteresis: 4 was set explicitly but mixed_precision 'mixed_precision config' sets 3 "
        "(remove the explicit optimizer.hysteresis or choose another mixed_precision preset)"
    ]


def test_explicit_value_equal_to_the_preset_is_fine():
    cfg = tiny_config(model=tiny_model(bf16=True), mixed_precision="bf16_mixed")
    runtime_config_update(cfg)
    assert cfg.model.bf16 and cfg.optimizer.bf16


def test_changing_the_preset_between_updates_reapplies():
    cfg = tiny_config(mixed_precision="bf16_mixed")
    runtime_config_update(cfg)
    cfg.mixed_precision = "fp16_mixed"
    runtime_config_update(cfg)
    assert cfg.model.fp16 and not cfg.model.bf16 and cfg.model.params_dtype == torch.half


def test_mixed_precision_config_checks():
    with pytest.raises(ConfigValidationError, match="mixed_precision.bf16: fp16 and bf16 are both on"):
        runtime_config_update(tiny_config(mixed_precision=MixedPrecisionConfig(fp16=True, bf16=True)))
    with pytest.raises(ConfigValidationError, match="FP8/FP4 training needs bf16 or fp16 as the higher precision"):
        runtime_config_update(tiny_config(mixed_precision=MixedPrecisionConfig(fp8="hybrid")))


def test_setup_applies_a_preset_to_the_configs_it_is_given():
    """`setup(model, optimizer=None, ddp=None)`, the reference system's way to apply a preset
    outside a container, also on megatron-core's own config classes."""
    from megatron.core.distributed import DistributedDataParallelConfig as CoreDDPConfig
    from megatron.core.transformer import TransformerConfig

    model, optimizer, ddp = tiny_model(), OptimizerConfig(lr=1e-3), DistributedDataParallelConfig()
    get_mixed_precision_config("bf16_mixed").setup(model, optimizer, ddp)
    assert model.bf16 and model.params_dtype == model.pipeline_dtype == torch.bfloat16
    assert optimizer.bf16 and optimizer.params_dtype == torch.bfloat16 and ddp.grad_reduce_in_fp32 is True
    assert not model.is_explicit("bf16")  # still the framework's value

    alone = tiny_model()
    get_mixed_precision_config("fp16_mixed").setup(alone)
    assert alone.fp16 and alone.params_dtype == torch.half

    core_model, core_ddp = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4), CoreDDPConfig()
    get_mixed_precision_config("bf16_mixed").setup(core_model, ddp_config=core_ddp)
    assert core_model.bf16 and core_model.params_dtype == torch.bfloat16 and core_ddp.grad_reduce_in_fp32


def test_setup_keeps_the_users_values_and_reports_contradictions():
    model = tiny_model(params_dtype=torch.float32)
    with pytest.raises(ConfigValidationError) as err:
        get_mixed_precision_config("bf16_mixed").setup(model)
    assert err.value.errors == [
        "model.params_dtype: torch.float32 was set explicitly but mixed_precision 'mixed_precision config' sets "
        "torch.bfloat16 (remove the explicit model.params_dtype or choose another mixed_precision preset)"
    ]
    assert model.params_dtype == torch.float32
    with pytest.raises(ConfigValidationError, match="mixed_precision.bf16: fp16 and bf16 are both on"):
        MixedPrecisionConfig(fp16=True, bf16=True).setup(tiny_model())


# ---------------------------------------------------------------------- comm overlap
def test_tp_overlap_turned_off_with_a_reason_said_once_per_config(caplog):
    cfg = tiny_config(comm_overlap=CommOverlapConfig(tp_comm_overlap=True))
    with caplog.at_level(logging.WARNING):
        runtime_config_update(cfg)
        runtime_config_update(cfg)  # resolving the same config again repeats nothing
    assert cfg.model.tp_comm_overlap is False
    assert caplog.messages == [
        "comm_overlap: tensor-parallel overlap turned off: tensor_model_parallel_size=1 (needs >= 2); "
        "sequence_parallel is off; TransformerEngine layers are not in use (transformer_impl='local')"
    ]


def test_tp_overlap_follows_where_transformer_engine_is_taken_as_installed(caplog):
    """A config resolved for machines with TransformerEngine (a dry run for GPUs) keeps the
    overlap; resolved for machines without it, it is turned off, saying why."""
    from megatron_bridge import extras

    def resolved(installed):
        model = tiny_model(tensor_model_parallel_size=2, sequence_parallel=True, transformer_impl="transformer_engine")
        cfg = tiny_config(model=model, comm_overlap=CommOverlapConfig(tp_comm_overlap=True))
        with extras.assume_installed(transformer_engine=installed):
            runtime_config_update(cfg, world_size=2)
        return cfg

    with caplog.at_level(logging.WARNING):
        assert resolved(True).model.tp_comm_overlap is True
        assert not caplog.messages
        assert resolved(False).model.tp_comm_overlap is False
    assert caplog.messages == [
        "comm_overlap: tensor-parallel overlap turned off: TransformerEngine layers are not in use "
        "(TransformerEngine is not installed)"
    ]
    assert extras.is_installed("transformer_engine") == extras.installed_here("transformer_engine")  # outside the block


@pytest.mark.parametrize(
    "pp, vp, layers, overlap_p2p, batch_p2p",
    [(1, None, 2, False, False), (2, None, 2, False, True), (2, 2, 4, True, False)],
)
def test_pipeline_overlap_defaults(pp, vp, layers, overlap_p2p, batch_p2p):
    model = tiny_model(num_layers=layers, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
    cfg = tiny_config(model=model, comm_overlap=CommOverlapConfig())
    runtime_config_update(cfg, world_size=pp)
    assert (cfg.model.overlap_p2p_comm, cfg.model.batch_p2p_comm) == (overlap_p2p, batch_p2p)


def test_data_parallel_overlap_only_with_dp_and_distributed_optimizer():
    cfg = tiny_config(comm_overlap=CommOverlapConfig())
    cfg.ddp.use_distributed_optimizer = True
    runtime_config_update(cfg, world_size=2)
    assert cfg.ddp.overlap_grad_reduce and cfg.ddp.overlap_param_gather
    assert cfg.optimizer.overlap_param_gather  # kept in sync with ddp
    assert cfg.ddp.bucket_size == DEFAULT_BUCKET_SIZE == 128 * 1024 * 1024
    single = tiny_config(comm_overlap=CommOverlapConfig())
    single.ddp.use_distributed_optimizer = True
    runtime_config_update(single, world_size=1)
    assert not single.ddp.overlap_grad_reduce and single.ddp.bucket_size is None


def test_resolving_again_for_another_world_size_replans_the_overlap():
    """The result of a second runtime_config_update is the one a fresh config gets: nothing
    planned for the first world size (parameter-gather overlap at DP 8) survives at DP 1."""

    def config():
        cfg = tiny_config(comm_overlap=CommOverlapConfig())
        cfg.ddp.use_distributed_optimizer = True
        cfg.train.global_batch_size = 16
        return cfg

    again, fresh = config(), config()
    runtime_config_update(again, world_size=8)
    assert again.ddp.overlap_param_gather and again.optimizer.overlap_param_gather
    runtime_config_update(again, world_size=1)
    runtime_config_update(fresh, world_size=1)
    assert again.to_dict() == fresh.to_dict()
    assert not again.ddp.overlap_grad_reduce and not again.ddp.overlap_param_gather
    assert not again.optimizer.overlap_param_gather

    mine = config()
    mine.optimizer.overlap_param_gather = True  # the user's, on one section: the other follows it
    runtime_config_update(mine, world_size=1)
    assert mine.ddp.overlap_param_gather and mine.optimizer.overlap_param_gather


def test_comm_overlap_setup_applies_it_once_the_data_parallel_size_is_set():
    cfg = tiny_config(ddp=DistributedDataParallelConfig(use_distributed_optimizer=True))
    overlap = CommOverlapConfig(tp_comm_overlap=False)
    with pytest.raises(ConfigValidationError) as err:
        overlap.setup(cfg.model, cfg.optimizer, cfg.ddp)
    assert err.value.errors == [
        "comm_overlap.data_parallel_size: is unknown: comm_overlap is finalized by runtime_config_update "
        "(call runtime_config_update(cfg), or set comm_overlap.data_parallel_size before finalize()/setup())"
    ]
    overlap.data_parallel_size = 2
    overlap.setup(cfg.model, cfg.optimizer, cfg.ddp)
    assert cfg.ddp.overlap_grad_reduce and cfg.ddp.bucket_size == DEFAULT_BUCKET_SIZE


def test_user_values_win_over_comm_overlap_defaults():
    cfg = tiny_config(comm_overlap=CommOverlapConfig())
    cfg.ddp.use_distributed_optimizer = True
    cfg.ddp.overlap_grad_reduce = False
    cfg.ddp.bucket_size = 1000
    runtime_config_update(cfg, world_size=2)
    assert cfg.ddp.overlap_grad_reduce is False and cfg.ddp.bucket_size == 1000
    assert cfg.ddp.overlap_param_gather is True


def test_contradiction_between_comm_overlap_and_an_explicit_target_value():
    cfg = tiny_config(comm_overlap=CommOverlapConfig(overlap_grad_reduce=True))
    cfg.ddp.overlap_grad_reduce = False
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg, world_size=2)
    assert err.value.errors == [
        "ddp.overlap_grad_reduce: False contradicts comm_overlap.overlap_grad_reduce=True (set overlap_grad_reduce in one place only)"
    ]
