"""Rules the reference system's config tests pin down: precision presets, FP8 parameters,
sample-based iteration counts, context-parallel fine-tuning, deterministic mode, schedule lengths."""

import logging

import pytest
import torch
from factories import tiny_config, tiny_model

from megatron_bridge.training.config import (
    ConfigValidationError,
    DistributedDataParallelConfig,
    FinetuningDatasetConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainingConfig,
    runtime_config_update,
)
from megatron_bridge.training.mixed_precision import PRESETS, get_mixed_precision_config


def errors_of(cfg, **kw):
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg, **kw)
    return err.value.errors


@pytest.mark.parametrize("name", ["bf16_with_mxfp8_mixed", "fp16_with_mxfp8_mixed"])
def test_mxfp8_presets_use_e4m3_and_gather_fp8_params_through_the_grad_buffer(name):
    mp = get_mixed_precision_config(name)
    assert (mp.fp8, mp.fp8_recipe) == ("e4m3", "mxfp8")
    assert mp.fp8_param_gather is True and mp.reuse_grad_buf_for_mxfp8_param_ag is True
    cfg = tiny_config(mixed_precision=name, ddp=DistributedDataParallelConfig(use_distributed_optimizer=True))
    runtime_config_update(cfg, world_size=1)
    assert cfg.ddp.fp8_param_gather and cfg.ddp.reuse_grad_buf_for_mxfp8_param_ag
    assert cfg.model.fp8 == "e4m3" and cfg.model.fp8_param is True


@pytest.mark.parametrize("name", ["bf16_with_fp8_subchannel_scaling_mixed", "fp16_with_fp8_subchannel_scaling_mixed"])
def test_subchannel_presets_use_hybrid_fp8(name):
    mp = get_mixed_precision_config(name)
    assert (mp.fp8, mp.fp8_recipe) == ("hybrid", "blockwise")


def test_fp8_param_without_fp8_param_gather_is_refused():
    mp = get_mixed_precision_config("bf16_with_fp8_delayed_scaling_mixed")
    mp.fp8_param, mp.fp8_param_gather = True, False
    (message,) = errors_of(tiny_config(mixed_precision=mp))  # reported once: finalized by its preset rule only
    assert message.startswith("mixed_precision.fp8_param: fp8_param=True but fp8_param_gather=False")
    assert "set both to the same value" in message


FP8_GATHERING_PRESETS = [n for n in PRESETS if get_mixed_precision_config(n).fp8_param_gather]


def test_fp8_presets_gather_parameters_in_fp8_only_with_the_distributed_optimizer(caplog):
    """megatron-core gathers parameters only in its distributed optimizer: without it, a preset
    leaves FP8 parameter gathering off (and says so); with it, whichever section turns it on
    (ddp or optimizer: they are synced before the preset), the preset turns gathering on."""
    assert len(FP8_GATHERING_PRESETS) == 6  # every FP8 preset but the two sub-channel ones
    for name in FP8_GATHERING_PRESETS:
        cfg = tiny_config(mixed_precision=name)
        with caplog.at_level(logging.INFO, logger="megatron_bridge"):
            runtime_config_update(cfg, world_size=1)
        assert not (cfg.ddp.fp8_param_gather or cfg.model.fp8_param or cfg.ddp.reuse_grad_buf_for_mxfp8_param_ag), name
        assert cfg.model.fp8 is not None  # still an FP8 run
        assert f"mixed_precision {name!r}: FP8 parameter gathering left off (it needs the distributed optimizer" in caplog.text
        cfg = tiny_config(mixed_precision=name, optimizer=OptimizerConfig(lr=3e-3, use_distributed_optimizer=True))
        runtime_config_update(cfg, world_size=1)
        assert cfg.ddp.use_distributed_optimizer and cfg.ddp.fp8_param_gather and cfg.model.fp8_param, name
        # the preset is re-applied when the distributed optimizer is turned off again
        cfg.optimizer.use_distributed_optimizer = False
        runtime_config_update(cfg, world_size=1)
        assert not (cfg.ddp.fp8_param_gather or cfg.model.fp8_param), name


@pytest.mark.parametrize(
    "asked, where",
    [
        ({"mixed_precision.fp8_param_gather": True}, "mixed_precision.fp8_param_gather"),
        ({"ddp.fp8_param_gather": True}, "ddp.fp8_param_gather"),
        ({"model.fp8_param": True}, "model.fp8_param"),
    ],
)
def test_fp8_param_gather_the_user_asked_for_needs_the_distributed_optimizer(asked, where):
    from megatron_bridge.config.overrides import process_config_with_overrides

    cfg = tiny_config(mixed_precision="bf16_with_fp8_current_scaling_mixed")
    process_config_with_overrides(cfg, cli_overrides=[f"{key}={str(value).lower()}" for key, value in asked.items()])
    (message,) = errors_of(cfg, world_size=1)
    assert message == (
        f"{where}: True asks for parameters gathered in FP8, which needs the distributed optimizer "
        "(megatron-core gathers parameters only there), but ddp.use_distributed_optimizer=False "
        f"(set ddp.use_distributed_optimizer=True, or {where}=False)"
    )
    cfg.ddp.use_distributed_optimizer = True
    runtime_config_update(cfg, world_size=1)
    assert cfg.ddp.fp8_param_gather and cfg.model.fp8_param


def test_mxfp8_parameters_gathered_in_fp8_reuse_the_gradient_buffer():
    """NVIDIA Megatron Bridge's rule: fp8_param_gather with the mxfp8 recipe needs
    reuse_grad_buf_for_mxfp8_param_ag (megatron-core would keep a second buffer instead)."""
    distributed = DistributedDataParallelConfig(use_distributed_optimizer=True)
    mp = get_mixed_precision_config("bf16_with_mxfp8_mixed")
    mp.reuse_grad_buf_for_mxfp8_param_ag = False
    assert errors_of(tiny_config(mixed_precision=mp, ddp=distributed), world_size=1) == [
        "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag: False, but MXFP8 parameters are gathered in FP8 "
        "(fp8_param_gather=True, fp8_recipe='mxfp8'), which reuses the gradient buffer for the all-gather "
        "(set mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=True, or fp8_param_gather=False)"
    ]
    mp.fp8_param_gather = mp.fp8_param = False  # not gathered in FP8: nothing to reuse
    runtime_config_update(tiny_config(mixed_precision=mp, ddp=distributed), world_size=1)


def test_model_fp8_param_and_ddp_fp8_param_gather_must_agree():
    cfg = tiny_config(model=tiny_model(fp8_param=True), mixed_precision="bf16_mixed")
    message = next(e for e in errors_of(cfg) if e.startswith("ddp.fp8_param_gather"))
    assert "False but model.fp8_param=True" in message and "set both alike" in message


def test_sample_based_train_iters_floor_like_megatron_lm():
    cfg = tiny_config(train=TrainingConfig(train_samples=10000, global_batch_size=32, micro_batch_size=2))
    runtime_config_update(cfg, world_size=1)
    assert cfg.train.train_iters == 312


def test_fewer_samples_than_one_batch_is_refused():
    cfg = tiny_config(train=TrainingConfig(train_samples=10, global_batch_size=32, micro_batch_size=2))
    (message,) = errors_of(cfg, world_size=1)
    assert message.startswith("train.train_samples: 10 samples make no whole global batch of 32")


def test_rampup_with_train_samples_gives_train_iters():
    # Ramp 8 -> 16 -> 24 -> 32 over 300 samples, then full batches of 32 (Megatron-LM's count).
    train = TrainingConfig(train_samples=1000, global_batch_size=32, micro_batch_size=8, rampup_batch_size=[8, 8, 300])
    cfg = tiny_config(train=train)
    runtime_config_update(cfg, world_size=1)
    # ramp-up: 100 samples per increment; consumed 0..:8x13 (104) 16x6 (200) 24x5 (320) = 24 steps
    # then (1000 - 320) // 32 = 21 steps
    assert cfg.train.train_iters == 45


@pytest.mark.parametrize(
    "rampup, message",
    [
        ([32, 8, 300], "train.rampup_batch_size: a ramp from 32 in steps of 8 does not end at global_batch_size=32"),
        ([8, 10, 300], "train.rampup_batch_size: a ramp from 8 in steps of 10 does not end at global_batch_size=32"),
        ([40, 8, 300], "train.rampup_batch_size: a ramp from 40 in steps of 8 does not end at global_batch_size=32"),
        (
            [4, 4, 300],
            (
                "train.rampup_batch_size: the ramp's batch sizes 4, 8, ... are not all divisible by "
                "micro_batch_size x data_parallel_size = 8 x 1 = 8 (use a start and an increment that are multiples of 8)"
            ),
        ),
    ],
)
def test_rampups_megatron_core_would_stop_on_are_refused(rampup, message):
    train = TrainingConfig(train_iters=10, global_batch_size=32, micro_batch_size=8, rampup_batch_size=rampup)
    (error,) = errors_of(tiny_config(train=train), world_size=1)
    assert error.startswith(message)


def test_an_accepted_rampup_runs_through_megatron_cores_calculator():
    """What the checks accept, megatron-core's calculator takes from start to end with its
    consistency checks on; the refused [4, 4, 300] (micro batch 8) stops it at the first step."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    def run(rampup):
        calc = RampupBatchsizeNumMicroBatchesCalculator(32, 8, 1, False, 0, *rampup)
        sizes = []
        for consumed in range(0, 400, 4):
            calc.update(consumed, consistency_check=True)
            sizes.append(calc.get_current_global_batch_size())
        return sizes

    train = TrainingConfig(train_iters=10, global_batch_size=32, micro_batch_size=8, rampup_batch_size=[8, 8, 300])
    runtime_config_update(tiny_config(train=train), world_size=1)
    assert sorted(set(run([8, 8, 300]))) == [8, 16, 24, 32]
    with pytest.raises(AssertionError, match="not divisible"):
        run([4, 4, 300])


def _consumed_by_calculator(iterations, gbs, rampup):
    """Samples consumed after each iteration, megatron-core's calculator stepped as the loop steps it."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    calc = RampupBatchsizeNumMicroBatchesCalculator(gbs, 1, 1, False, 0, *rampup)
    consumed = [0]
    for _ in range(iterations):
        calc.update(consumed[-1], consistency_check=False)
        consumed.append(consumed[-1] + calc.get_current_global_batch_size())
    return consumed


@pytest.mark.parametrize(
    "gbs, rampup",
    [(32, [16, 8, 5000]), (8, [4, 2, 40]), (48, [3, 3, 1000]), (40, [8, 16, 777]), (10, [1, 1, 7])],
)
def test_samples_after_iterations_match_megatron_cores_calculator(gbs, rampup):
    from megatron_bridge.training.config.run_rules import samples_after

    consumed = _consumed_by_calculator(1200, gbs, rampup)
    assert [samples_after(n, gbs, rampup) for n in range(1201)] == consumed


def test_iteration_based_schedule_with_rampup_covers_the_samples_consumed():
    """1000 iterations of the ramp 16 -> 32 in steps of 8 over 5000 samples consume 28,656
    samples, not 1000 x 32 = 32,000: the decay, the weight-decay ramp, the warmup (its first 50
    iterations) and WSD's final phase (the last 100 iterations of the decay) are sized in those."""
    consumed = _consumed_by_calculator(1000, 32, [16, 8, 5000])
    assert consumed[1000] == 28656
    train = TrainingConfig(train_iters=1000, global_batch_size=32, micro_batch_size=8, rampup_batch_size=[16, 8, 5000])
    scheduler = SchedulerConfig(lr_decay_style="WSD", lr_warmup_iters=50, lr_wsd_decay_iters=100)
    cfg = tiny_config(train=train, scheduler=scheduler)
    runtime_config_update(cfg, world_size=1)
    s = cfg.scheduler
    assert (s.lr_decay_steps, s.wd_incr_steps, s.lr_warmup_steps) == (28656, 28656, consumed[50])
    assert s.wsd_decay_steps == 28656 - consumed[900] == 3200
    # lr_decay_iters and max_steps count iterations of the ramp too
    cfg = tiny_config(train=train, scheduler=SchedulerConfig(lr_decay_iters=300, max_steps=1200))
    runtime_config_update(cfg, world_size=1)
    assert (cfg.scheduler.lr_decay_steps, cfg.scheduler.wd_incr_steps) == (consumed[300], 28656 + 200 * 32)


def _finetuning(tmp_path, cp=2, **model):
    (tmp_path / "training.jsonl").write_text('{"input": "a", "output": "b"}\n')
    return tiny_config(
        model=tiny_model(context_parallel_size=cp, **model),
        dataset=FinetuningDatasetConfig(dataset_root=str(tmp_path), seq_length=32),
    )


def test_context_parallel_finetuning_needs_the_per_token_loss(tmp_path):
    errors = errors_of(_finetuning(tmp_path), world_size=2)
    message = next(e for e in errors if e.startswith("model.calculate_per_token_loss"))
    assert "context_parallel_size=2" in message and "set model.calculate_per_token_loss=True" in message


def test_context_parallel_finetuning_refuses_average_in_collective(tmp_path):
    cfg = _finetuning(tmp_path, calculate_per_token_loss=True)
    cfg.ddp.average_in_collective = True
    errors = errors_of(cfg, world_size=2)
    message = next(e for e in errors if e.startswith("ddp.average_in_collective"))
    assert "set ddp.average_in_collective=False" in message
    assert not any(e.startswith("model.calculate_per_token_loss") for e in errors)


def test_context_parallel_finetuning_with_per_token_loss_validates(tmp_path):
    cfg = _finetuning(tmp_path, calculate_per_token_loss=True)
    runtime_config_update(cfg, world_size=2)


def test_scheduler_max_steps_shorter_than_train_iters_is_refused():
    cfg = tiny_config(scheduler=SchedulerConfig(max_steps=10))
    (message,) = errors_of(cfg, world_size=1)
    assert message.startswith("scheduler.max_steps: 10 iterations is shorter than train.train_iters=20")
    longer = tiny_config(scheduler=SchedulerConfig(max_steps=40))
    runtime_config_update(longer, world_size=1)  # a job doing the first part of a longer run


@pytest.mark.timeout(120)
def test_deterministic_mode_turns_on_torch_deterministic_algorithms(tmp_path):
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    cfg = tiny_config(model=tiny_model(deterministic_mode=True, cross_entropy_loss_fusion=False))
    cfg.train.train_iters = 2
    cfg.validation.eval_iters = 0
    cfg.env_vars = {"NCCL_ALGO": "Ring"}
    from megatron_bridge.training.callbacks import Callback

    class During(Callback):
        def on_step_end(self, state, metrics):
            seen.append(torch.are_deterministic_algorithms_enabled())

    seen = []
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        state = pretrain(cfg, forward_step, callbacks=[During()])
        assert seen == [True, True]
        assert state.train_state.step == 2
        # the setting is the run's: a later run in this process starts from torch's own
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_warmup_longer_than_the_run_is_reported_in_iterations():
    cfg = tiny_config(scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=30))
    (message,) = errors_of(cfg, world_size=1)
    assert message.startswith(
        "scheduler.lr_warmup_iters: warmup (30 iterations) is not shorter than the decay (20 iterations)"
    )


def test_recipe_warmup_scales_down_to_a_short_run(caplog):
    from recipes import llama3_8b_pretrain_config, tiny_gpt_pretrain_config

    cfg = tiny_gpt_pretrain_config(dir="/tmp/unused-run-dir")
    cfg.train.train_iters = 5
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        runtime_config_update(cfg, world_size=1)
    assert cfg.scheduler.lr_warmup_iters == 0
    assert "the recipe's warmup of 10 iterations is not shorter than the 5-iteration decay; using 0" in caplog.text
    big = llama3_8b_pretrain_config(dir="/tmp/unused-run-dir")
    big.train.train_iters = 1000
    runtime_config_update(big, world_size=8)
    assert big.scheduler.lr_warmup_iters == 100
    # a warmup the user sets is the user's: reported, not changed
    big.scheduler.lr_warmup_iters = 2000
    (message,) = errors_of(big, world_size=8)
    assert "warmup (2000 iterations) is not shorter than the decay (1000 iterations)" in message


def test_recipe_warmup_becomes_samples_when_the_recipe_is_switched_to_samples(caplog, tmp_path):
    """The recipe's warmup is in iterations; a run given in samples gets the samples of those
    iterations (a tenth of the run when not shorter), not a report of mixed units it never set."""
    from megatron_bridge.config.serialization import to_yaml
    from megatron_bridge.training.config import ConfigContainer
    from recipes import tiny_gpt_pretrain_config

    cfg = tiny_gpt_pretrain_config(dir="/tmp/unused-run-dir")
    cfg.train.train_iters, cfg.train.train_samples = None, 1600
    with caplog.at_level(logging.INFO, logger="megatron_bridge"):
        runtime_config_update(cfg, world_size=1)
    s = cfg.scheduler
    assert (s.lr_warmup_iters, s.lr_warmup_samples, s.lr_warmup_steps) == (0, 80, 80)  # 10 x 8
    assert "the recipe's warmup of 10 iterations, in sample-based training, is a warmup of 80 samples" in caplog.text
    resolved = cfg.to_dict()
    runtime_config_update(cfg, world_size=1)
    to_yaml(cfg, tmp_path / "run.yaml")
    loaded = ConfigContainer.from_yaml(tmp_path / "run.yaml")
    runtime_config_update(loaded, world_size=1)
    assert cfg.to_dict() == loaded.to_dict() == resolved

    short = tiny_gpt_pretrain_config(dir="/tmp/unused-run-dir")
    short.train.train_iters, short.train.train_samples = None, 40
    runtime_config_update(short, world_size=1)
    assert short.scheduler.lr_warmup_samples == 4  # 80 samples is not shorter than 40: a tenth
    mine = tiny_gpt_pretrain_config(dir="/tmp/unused-run-dir")
    mine.train.train_iters, mine.train.train_samples = None, 1600
    mine.scheduler.lr_warmup_iters = 10  # the user's: reported, not converted
    (message,) = errors_of(mine, world_size=1)
    assert message.startswith("scheduler.lr_warmup_iters: sample-based training (train.train_samples) with")


@pytest.mark.timeout(120)
def test_recipe_warmup_scales_down_for_a_constant_lr_too(tmp_path):
    """A constant LR is warmed up as well, and megatron-core's scheduler refuses a warmup that is
    not shorter than the run: the recipe's warmup scales down and the run trains."""
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain
    from recipes import tiny_gpt_pretrain_config

    cfg = tiny_gpt_pretrain_config(dir=str(tmp_path), train_iters=3)
    cfg.scheduler.lr_decay_style = "constant"
    cfg.validation.eval_interval, cfg.validation.eval_iters = None, 0
    cfg.checkpoint.save = cfg.checkpoint.load = None
    state = pretrain(cfg, forward_step)
    assert state.train_state.step == 3
    assert cfg.scheduler.lr_warmup_iters == 0 and cfg.scheduler.lr_warmup_steps < cfg.scheduler.lr_decay_steps


def test_yaml_floats_at_their_shortest_round_trip_form(tmp_path):
    from megatron_bridge.training.config import ConfigContainer

    cfg = tiny_config()
    cfg.optimizer.adam_eps, cfg.optimizer.lr, cfg.optimizer.min_lr = 1e-8, 3e-4, 1e-16
    text = cfg.to_yaml()
    assert "  adam_eps: 1e-08\n" in text and "  lr: 0.0003\n" in text and "  min_lr: 1e-16\n" in text
    assert "1.0e-" not in text
    path = tmp_path / "c.yaml"
    path.write_text(text)
    back = ConfigContainer.from_yaml(str(path))
    assert (back.optimizer.adam_eps, back.optimizer.lr, back.optimizer.min_lr) == (1e-8, 3e-4, 1e-16)


def test_an_unset_decay_length_is_filled_in_from_the_run_and_recomputed_after_an_edit():
    cfg = tiny_config(scheduler=SchedulerConfig(max_steps=None))
    cfg.validate()
    assert cfg.scheduler.lr_decay_iters == cfg.train.train_iters == 20
    assert cfg.scheduler.lr_decay_steps == 20 * 8
    cfg.train.train_iters = 40
    cfg.validate()
    assert cfg.scheduler.lr_decay_iters == 40 and cfg.scheduler.lr_decay_steps == 40 * 8
    samples = tiny_config(train=TrainingConfig(train_samples=160, global_batch_size=8, micro_batch_size=2))
    samples.validate()
    assert samples.scheduler.lr_decay_samples == 160 and samples.scheduler.lr_decay_iters is None
    own = tiny_config(scheduler=SchedulerConfig(lr_decay_iters=None))  # the user's None is kept
    own.validate()
    assert own.scheduler.lr_decay_iters is None and own.scheduler.lr_decay_steps == 20 * 8


def test_data_parallel_size_methods(monkeypatch):
    from megatron_bridge.training.comm_overlap import CommOverlapConfig

    cfg = tiny_config(model=tiny_model(tensor_model_parallel_size=2), comm_overlap=CommOverlapConfig())
    assert cfg.get_data_parallel_size(8) == 4 and cfg.data_parallel_size is None
    with pytest.raises(ConfigValidationError) as err:
        cfg.get_data_parallel_size(7)
    assert err.value.errors == [
        "data_parallel_size: world size 7 is not divisible by tensor x pipeline x context parallel = 2 x 1 x 1 "
        "(launch a multiple of TP x PP x CP processes or change the parallel sizes)"
    ]
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg.set_data_parallel_size()
    assert cfg.data_parallel_size == 2 and cfg.comm_overlap.data_parallel_size == 2
    assert cfg.scheduler.lr_decay_steps is None  # nothing else is resolved
