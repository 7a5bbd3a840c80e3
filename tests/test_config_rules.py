"""One test per validation rule of `runtime_config_update` / `ConfigContainer.validate`, matched on
the message the user sees."""

import logging
import os

import pytest
import torch
from factories import tiny_config, tiny_model

from megatron_bridge import extras
from megatron_bridge.training.config import (
    CheckpointConfig,
    ConfigValidationError,
    DistributedDataParallelConfig,
    FinetuningDatasetConfig,
    LoggerConfig,
    MissingPackageError,
    MockGPTDatasetConfig,
    NVRxStragglerDetectionConfig,
    OptimizerConfig,
    ProfilingConfig,
    SchedulerConfig,
    TrainingConfig,
    ValidationConfig,
    runtime_config_update,
)


def problems_of(cfg, world_size=1):
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg, world_size=world_size)
    return err.value.errors


def only_problem(cfg, world_size=1):
    errors = problems_of(cfg, world_size)
    assert len(errors) == 1, errors
    return errors[0]


# ---------------------------------------------------------------------- parallel sizes / batches
def test_world_size_must_be_divisible_by_tp_pp_cp():
    cfg = tiny_config(model=tiny_model(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    assert only_problem(cfg, world_size=6) == (
        "data_parallel_size: world size 6 is not divisible by tensor x pipeline x context parallel = 2 x 2 x 1 "
        "(launch a multiple of TP x PP x CP processes or change the parallel sizes)"
    )


def test_world_size_comes_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = tiny_config()
    runtime_config_update(cfg)
    assert cfg.data_parallel_size == 4


def test_global_batch_must_be_divisible_by_micro_batch_times_dp():
    cfg = tiny_config(train=TrainingConfig(train_iters=5, global_batch_size=12, micro_batch_size=2))
    assert only_problem(cfg, world_size=4) == (
        "train.global_batch_size: 12 is not divisible by micro_batch_size x data_parallel_size = 2 x 4 = 8 "
        "(use a multiple of 8, e.g. 8)"
    )


def test_eval_batch_sizes_default_to_train_and_are_checked():
    cfg = tiny_config()
    runtime_config_update(cfg)
    assert (cfg.validation.eval_global_batch_size, cfg.validation.eval_micro_batch_size) == (8, 2)
    bad = tiny_config(validation=ValidationConfig(eval_iters=2, eval_global_batch_size=6, eval_micro_batch_size=4))
    assert only_problem(bad) == (
        "validation.eval_global_batch_size: 6 is not divisible by eval_micro_batch_size x data_parallel_size = "
        "4 x 1 = 4 (use a multiple of 4, e.g. 4)"
    )


@pytest.mark.parametrize(
    "train, text",
    [
        (
            TrainingConfig(train_iters=5, train_samples=40, global_batch_size=8, micro_batch_size=2),
            "train.train_iters: train_iters (5) and train_samples (40) are both set "
            "(set exactly one of train.train_iters / train.train_samples)",
        ),
        (
            TrainingConfig(global_batch_size=8, micro_batch_size=2),
            "train.train_iters: neither train_iters nor train_samples is set (set train.train_iters)",
        ),
    ],
)
def test_exactly_one_of_train_iters_and_train_samples(train, text):
    assert text in problems_of(tiny_config(train=train))


# ---------------------------------------------------------------------- scheduler
def test_iteration_based_scheduler_steps():
    cfg = tiny_config(scheduler=SchedulerConfig(lr_decay_iters=15, lr_warmup_iters=3))
    runtime_config_update(cfg)
    s = cfg.scheduler
    assert (s.lr_decay_steps, s.lr_warmup_steps, s.wd_incr_steps, s.wsd_decay_steps) == (15 * 8, 3 * 8, 20 * 8, None)


def test_warmup_fraction_and_max_steps():
    cfg = tiny_config(scheduler=SchedulerConfig(lr_warmup_fraction=0.1, max_steps=100))
    runtime_config_update(cfg)
    assert (cfg.scheduler.lr_decay_steps, cfg.scheduler.lr_warmup_steps, cfg.scheduler.wd_incr_steps) == (800, 80, 800)


def test_sample_based_scheduler_steps():
    cfg = tiny_config(
        train=TrainingConfig(train_samples=160, global_batch_size=8, micro_batch_size=2),
        scheduler=SchedulerConfig(lr_warmup_samples=16, lr_decay_style="WSD", lr_wsd_decay_samples=32),
    )
    runtime_config_update(cfg)
    s = cfg.scheduler
    assert (s.lr_decay_steps, s.lr_warmup_steps, s.wd_incr_steps, s.wsd_decay_steps) == (160, 16, 160, 32)


def test_wsd_decay_phase_defaults_to_the_whole_decay_and_must_fit_it():
    """As in NVIDIA Megatron Bridge, an unset lr_wsd_decay_iters is the decay length (the
    final phase is the whole decay); in samples alike. A set one must fit in the decay."""
    cfg = tiny_config(scheduler=SchedulerConfig(lr_decay_style="WSD", lr_decay_iters=15))
    runtime_config_update(cfg)
    s = cfg.scheduler
    assert (s.lr_wsd_decay_iters, s.wsd_decay_steps, s.lr_decay_steps) == (15, 15 * 8, 15 * 8)
    s.lr_decay_iters = 12  # derived again after an edit
    runtime_config_update(cfg)
    assert (s.lr_wsd_decay_iters, s.wsd_decay_steps) == (12, 12 * 8)
    cfg = tiny_config(
        train=TrainingConfig(train_samples=100, global_batch_size=8, micro_batch_size=2),
        scheduler=SchedulerConfig(lr_decay_style="WSD"),
    )
    runtime_config_update(cfg)
    assert (cfg.scheduler.lr_wsd_decay_samples, cfg.scheduler.wsd_decay_steps) == (100, 100)
    cfg = tiny_config(scheduler=SchedulerConfig(lr_decay_style="WSD", lr_wsd_decay_iters=50))
    assert "the WSD decay phase (50 iterations) is longer than the whole decay (20 iterations)" in only_problem(cfg)


def test_wsd_settings_need_the_wsd_schedule():
    cfg = tiny_config(scheduler=SchedulerConfig(lr_decay_style="cosine", lr_wsd_decay_iters=5, lr_wsd_decay_style="linear"))
    assert problems_of(cfg) == [
        "scheduler.lr_wsd_decay_style: 'linear' has no effect: lr_decay_style is 'cosine', not 'WSD' "
        "(set scheduler.lr_decay_style=WSD, or remove scheduler.lr_wsd_decay_style)",
        "scheduler.lr_wsd_decay_iters: 5 has no effect: lr_decay_style is 'cosine', not 'WSD' "
        "(set scheduler.lr_decay_style=WSD, or remove scheduler.lr_wsd_decay_iters)",
    ]
    cfg.scheduler.lr_decay_style = "WSD"
    runtime_config_update(cfg)


def test_warmup_not_shorter_than_decay_is_an_error():
    cfg = tiny_config(scheduler=SchedulerConfig(lr_warmup_iters=20, lr_decay_style="cosine"))
    assert only_problem(cfg) == (
        "scheduler.lr_warmup_iters: warmup (20 iterations) is not shorter than the decay (20 iterations) "
        "(shorten the warmup or lengthen lr_decay_iters / the training run)"
    )


def test_a_constant_lr_is_warmed_up_too_so_its_warmup_must_be_shorter_than_the_run():
    # megatron-core's scheduler asserts warmup < decay whatever the decay style
    cfg = tiny_config(scheduler=SchedulerConfig(lr_warmup_iters=20, lr_decay_style="constant"))
    assert only_problem(cfg) == (
        "scheduler.lr_warmup_iters: warmup (20 iterations) is not shorter than the decay (20 iterations) "
        "(shorten the warmup or lengthen lr_decay_iters / the training run)"
    )


@pytest.mark.parametrize(
    "train_iters, gbs, fraction", [(1, 8, 0.1), (1, 8, 0.99), (7, 3, 0.33), (13, 5, 0.5), (10, 8, 0.0), (4, 8, 0.3)]
)
def test_a_warmup_fraction_is_that_fraction_of_the_decay_samples_unrounded(train_iters, gbs, fraction):
    """Megatron-LM's (and NVIDIA Megatron Bridge's) warmup is fraction x decay samples, not
    rounded: 0.1 of one batch of 8 is a warmup of 0.8 samples (the first LR is lr_warmup_init),
    not none."""
    cfg = tiny_config(
        train=TrainingConfig(train_iters=train_iters, global_batch_size=gbs, micro_batch_size=1),
        scheduler=SchedulerConfig(lr_warmup_fraction=fraction),
    )
    runtime_config_update(cfg)
    assert cfg.scheduler.lr_decay_steps == train_iters * gbs
    assert cfg.scheduler.lr_warmup_steps == fraction * (train_iters * gbs)


def test_a_warmup_fraction_leaving_no_decay_is_reported_at_the_fraction():
    cfg = tiny_config(scheduler=SchedulerConfig(lr_warmup_fraction=1.0, lr_decay_style="cosine"))
    assert only_problem(cfg) == (
        "scheduler.lr_warmup_fraction: a warmup of 1.0 of the decay (20 iterations) leaves no decay "
        "(use a fraction below 1)"
    )


def test_a_warmup_starting_above_the_peak_lr_is_an_error():
    # megatron-core's scheduler asserts lr_warmup_init <= lr when it is built, with or without warmup
    cfg = tiny_config(scheduler=SchedulerConfig(lr_warmup_init=0.01, lr_warmup_iters=2))
    assert only_problem(cfg) == (
        "scheduler.lr_warmup_init: the warmup starts at 0.01, above the peak learning rate optimizer.lr=0.003 "
        "(set scheduler.lr_warmup_init to at most 0.003 (0.0 warms up from zero))"
    )
    runtime_config_update(tiny_config(scheduler=SchedulerConfig(lr_warmup_init=0.003, lr_warmup_iters=2)))


def test_iteration_and_sample_scheduler_fields_do_not_mix():
    cfg = tiny_config(scheduler=SchedulerConfig(lr_decay_iters=10, lr_warmup_samples=16))
    errors = problems_of(cfg)
    assert any("iteration-based fields ['lr_decay_iters'] are mixed with sample-based fields ['lr_warmup_samples']" in e for e in errors)
    sample_run = tiny_config(
        train=TrainingConfig(train_samples=160, global_batch_size=8, micro_batch_size=2),
        scheduler=SchedulerConfig(lr_decay_iters=10),
    )
    assert "sample-based training (train.train_samples) with iteration-based scheduler fields ['lr_decay_iters']" in (
        only_problem(sample_run)
    )


def test_one_fact_is_reported_once():
    """A mistake megatron-core would also refuse, or that two rules see, gives one problem."""
    mixed = tiny_config(scheduler=SchedulerConfig(lr_decay_iters=10, lr_decay_samples=100))
    assert only_problem(mixed).startswith(
        "scheduler.lr_decay_samples: iteration-based fields ['lr_decay_iters'] are mixed with sample-based fields"
    )
    no_experts = tiny_config(model=tiny_model(expert_model_parallel_size=2))
    assert only_problem(no_experts, world_size=2) == (
        "model.expert_model_parallel_size: expert parallelism (2) on a model without experts (num_moe_experts is not set) "
        "(set num_moe_experts or expert_model_parallel_size=1)"
    )
    both = tiny_config(
        model=tiny_model(bf16=True, fp16=True), optimizer=OptimizerConfig(lr=1e-3, bf16=True, fp16=True)
    )
    both.mixed_precision = None
    assert only_problem(both) == "model.bf16: model.bf16 and model.fp16 are both on (choose one)"


def test_weight_decay_range():
    errors = problems_of(tiny_config(scheduler=SchedulerConfig(start_weight_decay=-0.1, end_weight_decay=0.1)))
    assert "scheduler.start_weight_decay: -0.1 is outside the allowed range [0, 10] (choose a value in that range)" in errors
    assert (
        "scheduler.end_weight_decay: constant weight decay but start (-0.1) != end (0.1) "
        "(set weight_decay_incr_style='linear' or 'cosine', or make them equal)"
    ) in errors
    shrinking = tiny_config(
        scheduler=SchedulerConfig(start_weight_decay=0.1, end_weight_decay=0.01, weight_decay_incr_style="linear")
    )
    assert "start_weight_decay (0.1) exceeds end_weight_decay (0.01)" in only_problem(shrinking)
    negative = tiny_config(optimizer=OptimizerConfig(lr=1e-3, weight_decay=-1.0))
    assert "optimizer.weight_decay: -1.0 is outside the allowed range [0, 10] (choose a value in that range)" in problems_of(negative)


def test_weight_decay_schedule_defaults_to_optimizer_weight_decay():
    cfg = tiny_config(optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.05))
    runtime_config_update(cfg)
    assert cfg.scheduler.start_weight_decay == cfg.scheduler.end_weight_decay == 0.05


# ---------------------------------------------------------------------- distributed optimizer
def test_distributed_optimizer_is_kept_in_sync_and_says_so(caplog):
    cfg = tiny_config()
    cfg.ddp.use_distributed_optimizer = True
    with caplog.at_level(logging.INFO):
        runtime_config_update(cfg)
    assert cfg.optimizer.use_distributed_optimizer is True
    assert "setting optimizer.use_distributed_optimizer=True to match the other section" in caplog.text


def test_distributed_optimizer_contradiction_is_reported():
    cfg = tiny_config(optimizer=OptimizerConfig(lr=1e-3, use_distributed_optimizer=False))
    cfg.ddp.use_distributed_optimizer = True
    assert only_problem(cfg) == (
        "optimizer.use_distributed_optimizer: optimizer.use_distributed_optimizer=False but "
        "ddp.use_distributed_optimizer=True (set both to the same value (or only one of them))"
    )


def test_te_rng_tracker_is_one_setting_in_rng_and_model(caplog):
    """model.use_te_rng_tracker (megatron-core's name) turns on rng.te_rng_tracker, which the
    run's seeding reads, and the other way round, as in NVIDIA Megatron Bridge."""
    from megatron_bridge.training.config import RNGConfig

    cfg = tiny_config(model=tiny_model(use_te_rng_tracker=True))
    with caplog.at_level(logging.INFO):
        runtime_config_update(cfg)
    assert cfg.rng.te_rng_tracker is True
    assert "setting rng.te_rng_tracker=True to match the other section" in caplog.text
    cfg = tiny_config(rng=RNGConfig(te_rng_tracker=True))
    runtime_config_update(cfg)
    assert cfg.model.use_te_rng_tracker is True
    cfg.rng.te_rng_tracker = False  # the user's later choice wins over the synced value
    runtime_config_update(cfg)
    assert (cfg.rng.te_rng_tracker, cfg.model.use_te_rng_tracker) == (False, False)
    cfg = tiny_config(rng=RNGConfig(te_rng_tracker=True), model=tiny_model(use_te_rng_tracker=False))
    assert only_problem(cfg) == (
        "model.use_te_rng_tracker: model.use_te_rng_tracker=False but rng.te_rng_tracker=True "
        "(set both to the same value (or only one of them))"
    )


# ---------------------------------------------------------------------- precision
def test_mixed_precision_consistency_between_model_and_optimizer():
    cfg = tiny_config(model=tiny_model(bf16=True, params_dtype=torch.bfloat16))
    assert only_problem(cfg) == (
        "optimizer.bf16: model.bf16=True but optimizer.bf16=False "
        "(set both alike, or use mixed_precision='bf16_mixed' which sets both)"
    )


def test_fp8_and_fp4_are_exclusive():
    cfg = tiny_config(mixed_precision="bf16_with_fp8_current_scaling_mixed")
    cfg.mixed_precision = "bf16_with_fp8_current_scaling_mixed"
    from megatron_bridge.training.mixed_precision import get_mixed_precision_config

    mp = get_mixed_precision_config("bf16_with_fp8_current_scaling_mixed")
    mp.fp4 = "e2m1"
    cfg.mixed_precision = mp
    assert "mixed_precision.fp4: fp8='hybrid' and fp4='e2m1' are both set (train in FP8 or in FP4, not both)" in (
        problems_of(cfg)
    )
    model_level = tiny_config(model=tiny_model(fp8="hybrid", fp4="e2m1", bf16=True), optimizer=OptimizerConfig(lr=1e-3, bf16=True))
    assert "model.fp4: model.fp8='hybrid' and model.fp4='e2m1' are both set (train in FP8 or in FP4, not both)" in (
        problems_of(model_level)
    )


# ---------------------------------------------------------------------- sequence / context parallel
def test_sequence_length_must_match_between_model_and_dataset():
    cfg = tiny_config(dataset=MockGPTDatasetConfig(seq_length=64, num_workers=0))
    assert only_problem(cfg) == (
        "dataset.seq_length: model.seq_length=32 but dataset sequence length is 64 (set both to the same value)"
    )


def test_context_parallel_needs_sequence_divisible_by_2cp():
    cfg = tiny_config(
        model=tiny_model(seq_length=36, context_parallel_size=4), dataset=MockGPTDatasetConfig(seq_length=36)
    )
    assert "model.seq_length: 36 is not divisible by 2 x context_parallel_size = 8 (use a multiple of 8)" in (
        problems_of(cfg, world_size=4)
    )


def test_cp_comm_type_and_hierarchical_sizes():
    cfg = tiny_config(model=tiny_model(context_parallel_size=4, cp_comm_type="a2a+p2p"))
    assert only_problem(cfg, world_size=4) == (
        "model.hierarchical_context_parallel_sizes: cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes "
        "(set it, e.g. [2, 4] for context_parallel_size=8)"
    )
    cfg = tiny_config(
        model=tiny_model(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 3])
    )
    assert "their product 6 differs from context_parallel_size=4" in only_problem(cfg, world_size=4)
    cfg = tiny_config(model=tiny_model(context_parallel_size=2, cp_comm_type="ring"))
    assert "model.cp_comm_type: unknown kind(s) ['ring']" in only_problem(cfg, world_size=2)
    cfg = tiny_config(model=tiny_model(context_parallel_size=2, cp_comm_type="p2p", hierarchical_context_parallel_sizes=[2]))
    assert "set to [2] but cp_comm_type is 'p2p'" in only_problem(cfg, world_size=2)


def test_a_per_layer_cp_comm_type_of_the_wrong_length_is_reported_once():
    """megatron-core checks the length when context parallelism is on; ours covers the rest, and
    the two do not both report it."""
    cfg = tiny_config(model=tiny_model(context_parallel_size=2, cp_comm_type=["p2p"]))
    assert "Length of cp_comm_type (1) should equal to the total number of transformer layers (2)" in only_problem(
        cfg, world_size=2
    )
    assert only_problem(tiny_config(model=tiny_model(cp_comm_type=["p2p"]))) == (
        "model.cp_comm_type: a per-layer list needs 2 entries, got 1 (give one entry per layer or a single string)"
    )


def test_deterministic_mode_rules(monkeypatch):
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    cfg = tiny_config(model=tiny_model(deterministic_mode=True, cross_entropy_loss_fusion=True))
    errors = problems_of(cfg)
    assert (
        "model.cross_entropy_loss_fusion: the fused cross entropy is not deterministic "
        "(set model.cross_entropy_loss_fusion=False in deterministic mode)"
    ) in errors
    assert (
        "env_vars.NCCL_ALGO: deterministic mode needs NCCL_ALGO in ['Tree', 'Ring', 'CollnetDirect', "
        "'CollnetChain', '^NVLS'], got None (set env_vars={'NCCL_ALGO': 'Ring'})"
    ) in errors
    ok = tiny_config(model=tiny_model(deterministic_mode=True), env_vars={"NCCL_ALGO": "Ring"})
    runtime_config_update(ok)
    assert os.environ["NCCL_ALGO"] == "Ring"


def test_deterministic_mode_refuses_transformer_engine_flash_attention(monkeypatch):
    """As Megatron-LM and NVIDIA Megatron Bridge: TE's flash attention backward is not
    deterministic. On local layers `flash` is PyTorch SDPA, as `auto` is, and stays allowed."""
    from megatron.core.transformer.enums import AttnBackend

    monkeypatch.setenv("NCCL_ALGO", "Ring")
    te = dict(deterministic_mode=True, attention_backend=AttnBackend.flash, transformer_impl="transformer_engine")
    assert only_problem(tiny_config(model=tiny_model(**te))) == (
        "model.attention_backend: TransformerEngine's flash attention is not deterministic "
        "(set model.attention_backend='fused', 'unfused' or 'auto' in deterministic mode)"
    )
    runtime_config_update(tiny_config(model=tiny_model(**{**te, "attention_backend": AttnBackend.auto})))
    runtime_config_update(tiny_config(model=tiny_model(**{**te, "transformer_impl": "local"})))


@pytest.mark.parametrize("algo", ["Tree", "CollnetDirect", "CollnetChain", "^NVLS"])
def test_deterministic_mode_takes_megatron_lms_nccl_algorithms(monkeypatch, algo):
    """Megatron-LM and NVIDIA Megatron Bridge accept these five; only Ring was accepted besides Tree."""
    monkeypatch.setenv("NCCL_ALGO", algo)
    runtime_config_update(tiny_config(model=tiny_model(deterministic_mode=True)))
    monkeypatch.setenv("NCCL_ALGO", "NVLS")
    refused = tiny_config(model=tiny_model(deterministic_mode=True))
    assert "deterministic mode needs NCCL_ALGO in" in only_problem(refused)


def test_fine_grained_activation_offloading_needs_transformer_engine():
    cfg = tiny_config(model=tiny_model(fine_grained_activation_offloading=True))
    assert "model.fine_grained_activation_offloading: needs TransformerEngine layers, but transformer_impl='local'" in (
        only_problem(cfg)
    )


# ---------------------------------------------------------------------- sections
def test_profiling_rules():
    cfg = tiny_config(profiling=ProfilingConfig(use_pytorch_profiler=True, profile_step_start=5, profile_step_end=5))
    assert only_problem(cfg) == (
        "profiling.profile_step_end: profile_step_end (5) must be greater than profile_step_start (5) "
        "(set profiling.profile_step_end above profile_step_start)"
    )
    both = tiny_config(profiling=ProfilingConfig(use_pytorch_profiler=True, use_nsys_profiler=True))
    assert "profiling.use_pytorch_profiler: use_nsys_profiler and use_pytorch_profiler are both on" in only_problem(both)


def test_checkpoint_rules(tmp_path):
    errors = problems_of(tiny_config(checkpoint=CheckpointConfig(async_save=True, ckpt_format="zarr", ckpt_step=3)))
    assert "checkpoint.async_save: async_save needs a save directory (set checkpoint.save)" in errors
    assert "checkpoint.async_save: async_save is not supported with ckpt_format='zarr'" in " ".join(errors)
    assert (
        "checkpoint.ckpt_step: ckpt_step=3 is set but there is nothing to load "
        "(set checkpoint.load (or pretrained_checkpoint), or remove ckpt_step)"
    ) in errors
    missing = tmp_path / "nope"
    assert f"checkpoint.pretrained_checkpoint: directory {str(missing)!r} does not exist" in only_problem(
        tiny_config(checkpoint=CheckpointConfig(pretrained_checkpoint=str(missing)))
    )
    assert "checkpoint.most_recent_k: must be -1 (keep all) or >= 1, got 0" in only_problem(
        tiny_config(checkpoint=CheckpointConfig(most_recent_k=0))
    )


def test_loading_settings_without_a_load_directory_are_refused(tmp_path):
    ignored = tiny_config(checkpoint=CheckpointConfig(finetune=True, exit_on_missing_checkpoint=True))
    assert problems_of(ignored) == [
        "checkpoint.finetune: True has no effect: it loads the checkpoint in checkpoint.load as weights only, "
        "and load is not set (set checkpoint.load to the checkpoint directory, or remove checkpoint.finetune)",
        "checkpoint.exit_on_missing_checkpoint: True has no effect: it is about a checkpoint missing from "
        "checkpoint.load, and load is not set (set checkpoint.load to the checkpoint directory, or remove "
        "checkpoint.exit_on_missing_checkpoint)",
    ]
    # pretrained_checkpoint is read as weights only anyway: finetune adds nothing there
    weights = CheckpointConfig(finetune=True, pretrained_checkpoint=str(tmp_path))
    assert "checkpoint.finetune: True has no effect" in only_problem(tiny_config(checkpoint=weights))
    runtime_config_update(
        tiny_config(checkpoint=CheckpointConfig(load=str(tmp_path), finetune=True, exit_on_missing_checkpoint=True))
    )


def test_saving_settings_without_a_save_directory_are_refused():
    forgotten = tiny_config(checkpoint=CheckpointConfig(save_interval=5, most_recent_k=2))
    assert problems_of(forgotten) == [
        "checkpoint.save_interval: 5 has no effect: checkpoint.save is not set, so no checkpoint is written "
        "(set checkpoint.save to a directory, or remove checkpoint.save_interval)",
        "checkpoint.most_recent_k: 2 has no effect: checkpoint.save is not set, so no checkpoint is written "
        "(set checkpoint.save to a directory, or remove checkpoint.most_recent_k)",
    ]
    # save=None given on purpose (e.g. `checkpoint.save=null` over a recipe) turns saving off with its schedule
    runtime_config_update(tiny_config(checkpoint=CheckpointConfig(save=None, save_interval=5, most_recent_k=2)))


def test_garbage_collection_settings_need_manual_gc():
    cfg = tiny_config(train=TrainingConfig(train_iters=20, global_batch_size=8, micro_batch_size=2, manual_gc_interval=5))
    assert only_problem(cfg) == (
        "train.manual_gc_interval: 5 has no effect without train.manual_gc (Python's automatic garbage collection "
        "stays on) (set train.manual_gc=true to collect garbage on this schedule, or remove train.manual_gc_interval)"
    )
    cfg.train.manual_gc_interval, cfg.train.manual_gc_eval = 0, False
    assert "train.manual_gc_eval: False has no effect without train.manual_gc" in only_problem(cfg)
    cfg.train.manual_gc, cfg.train.manual_gc_interval = True, 5
    runtime_config_update(cfg)


def test_an_exit_signal_needs_the_exit_signal_handler():
    import signal

    cfg = tiny_config(train=TrainingConfig(train_iters=20, global_batch_size=8, micro_batch_size=2, exit_signal=signal.SIGUSR1))
    assert only_problem(cfg) == (
        "train.exit_signal: SIGUSR1 has no effect without train.exit_signal_handler (no handler is installed: the "
        "signal ends the run without a checkpoint) (set train.exit_signal_handler=true, or remove train.exit_signal)"
    )
    cfg.train.exit_signal_handler = True
    runtime_config_update(cfg)


def test_a_ckpt_step_that_no_loaded_checkpoint_has_is_refused(tmp_path):
    empty = tmp_path / "first_run"
    empty.mkdir()
    assert only_problem(tiny_config(checkpoint=CheckpointConfig(load=str(empty), ckpt_step=5))) == (
        f"checkpoint.ckpt_step: ckpt_step=5 asks for a saved iteration, but checkpoint.load={str(empty)!r} holds no "
        "checkpoint: the run would start without it (point checkpoint.load at the run that saved iteration 5, or "
        "remove ckpt_step)"
    )
    one_iteration = tmp_path / "ckpt" / "iter_0000004"
    one_iteration.mkdir(parents=True)
    assert only_problem(tiny_config(checkpoint=CheckpointConfig(pretrained_checkpoint=str(one_iteration), ckpt_step=2))) == (
        f"checkpoint.ckpt_step: ckpt_step=2, but checkpoint.pretrained_checkpoint={str(one_iteration)!r} is the "
        "directory of iteration 4 (point checkpoint.pretrained_checkpoint at the parent directory to pick an "
        "iteration, or remove ckpt_step)"
    )
    runtime_config_update(tiny_config(checkpoint=CheckpointConfig(pretrained_checkpoint=str(one_iteration), ckpt_step=4)))


def test_logger_rules():
    errors = problems_of(tiny_config(logger=LoggerConfig(mlflow_experiment="exp", comet_project="proj")))
    assert (
        "logger.mlflow_run_name: mlflow_experiment='exp' is set but mlflow_run_name is not (set logger.mlflow_run_name)"
    ) in errors
    assert (
        "logger.comet_experiment_name: comet_project='proj' is set but comet_experiment_name is not "
        "(set logger.comet_experiment_name)"
    ) in errors


def test_missing_tracker_package_is_module_not_found_naming_the_extra(monkeypatch):
    # The package is installed in the test environment; simulate a machine without it.
    monkeypatch.setattr(extras, "is_installed", lambda module: module != "mlflow")
    cfg = tiny_config(logger=LoggerConfig(mlflow_experiment="exp", mlflow_run_name="run"))
    with pytest.raises(ModuleNotFoundError) as err:
        runtime_config_update(cfg)
    assert isinstance(err.value, MissingPackageError) and isinstance(err.value, ConfigValidationError)
    assert err.value.errors == [
        "logger.mlflow_experiment: MLflow logging needs the 'mlflow' package (pip install 'megatron-bridge[mlflow]')"
    ]


def test_require_names_the_extra():
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'megatron-bridge\[te\]'"):
        extras.require("transformer_engine")


def test_nvrx_straggler_thresholds_and_interval():
    cfg = tiny_config(nvrx_straggler=NVRxStragglerDetectionConfig(gpu_relative_perf_threshold=1.5, report_time_interval=0))
    errors = problems_of(cfg)
    assert "nvrx_straggler.gpu_relative_perf_threshold: 1.5 is outside the allowed range [0, 1] (choose a value in that range)" in errors
    assert "nvrx_straggler.report_time_interval: 0 is outside the allowed range (0, inf) (choose a value in that range)" in errors


def test_nvrx_straggler_detection_needs_a_score_to_compute():
    off = dict(calc_relative_gpu_perf=False, calc_individual_gpu_perf=False)
    cfg = tiny_config(nvrx_straggler=NVRxStragglerDetectionConfig(enabled=True, **off))
    problems = problems_of(cfg)
    assert (
        "nvrx_straggler.calc_relative_gpu_perf: calc_relative_gpu_perf and calc_individual_gpu_perf are both "
        "False: the detector would compute no score and so never find a straggler "
        "(set nvrx_straggler.calc_relative_gpu_perf=True (or calc_individual_gpu_perf=True), or enabled=False)"
    ) in problems
    disabled = tiny_config(nvrx_straggler=NVRxStragglerDetectionConfig(**off))
    runtime_config_update(disabled, world_size=1)  # off: not checked
    if extras.is_installed("nvidia_resiliency_ext"):
        one = NVRxStragglerDetectionConfig(enabled=True, calc_relative_gpu_perf=False)
        runtime_config_update(tiny_config(nvrx_straggler=one), world_size=1)


def test_inprocess_restart_needs_at_least_one_iteration():
    from megatron_bridge.training.config import InProcessRestartConfig

    cfg = tiny_config(inprocess_restart=InProcessRestartConfig(max_iterations=0))
    assert (
        "inprocess_restart.max_iterations: 0 is outside the allowed range [1, 2**63) (choose a value in that range)"
        in problems_of(cfg)
    )


def test_peft_needs_a_pretrained_checkpoint():
    from megatron_bridge.peft import LoRA

    cfg = tiny_config(peft=LoRA())
    assert (
        "checkpoint.pretrained_checkpoint: LoRA trains adapters on top of pretrained weights, and none are given "
        "(set checkpoint.pretrained_checkpoint to the checkpoint of the base model)"
    ) in problems_of(cfg)


def test_finetuning_dataset_rules():
    cfg = tiny_config(dataset=FinetuningDatasetConfig(seq_length=64, num_workers=0))
    errors = problems_of(cfg)
    assert "dataset.dataset_root: is not set (set dataset.dataset_root to a directory)" in errors
    assert "dataset.seq_length: dataset.seq_length=64 exceeds model.seq_length=32 (set both to the same value)" in errors


def test_env_vars_are_applied_and_bad_ones_reported(monkeypatch):
    monkeypatch.delenv("MB_TEST_VAR", raising=False)
    cfg = tiny_config(env_vars={"MB_TEST_VAR": 3})
    runtime_config_update(cfg)
    assert os.environ["MB_TEST_VAR"] == "3"
    bad = tiny_config(env_vars={"": 1, "LIST_VAR": [1, 2]})
    errors = problems_of(bad)
    assert "env_vars.'': is not a valid environment variable name (use a non-empty name without '=')" in errors
    assert "env_vars.LIST_VAR: value [1, 2] is not a string or number (give a scalar value)" in errors


# ---------------------------------------------------------------------- all at once
def test_several_mistakes_are_reported_together():
    cfg = tiny_config(
        train=TrainingConfig(train_iters=0, global_batch_size=6, micro_batch_size=4),
        optimizer=OptimizerConfig(lr=None),
        dataset=MockGPTDatasetConfig(seq_length=64, num_workers=0),
        profiling=ProfilingConfig(use_pytorch_profiler=True, profile_step_start=3, profile_step_end=1),
    )
    errors = problems_of(cfg)
    for prefix in (
        "train.train_iters: 0 is outside the allowed range [1, 2**63)",
        "optimizer.lr: the learning rate is not set",
        "train.global_batch_size: 6 is not divisible",
        "dataset.seq_length: model.seq_length=32",
        "profiling.profile_step_end",
    ):
        assert any(e.startswith(prefix) for e in errors), (prefix, errors)
    assert len(errors) >= 5


def test_range_check_fast_path_agrees_with_the_range_of_every_numeric_field():
    """`ranges.check` skips the call for plain in-range numbers; on boundaries, infinities, NaN
    and huge ints it must decide exactly as `Range.problem`."""
    from megatron_bridge.config import ranges
    from megatron_bridge.config.errors import Problems
    from megatron_bridge.models import Llama3ModelProvider8B
    from megatron_bridge.training.config import OptimizerConfig, SchedulerConfig, TrainingConfig

    for cls in (Llama3ModelProvider8B, OptimizerConfig, SchedulerConfig, TrainingConfig):
        for name, rng in ranges.numeric_fields(cls):
            edges = [0, 1, -1, 0.5, 10**30, -(10**30), float("inf"), float("-inf"), float("nan")]
            for bound in (rng.low, rng.high):
                if bound is not None:
                    edges += [bound, bound - 1, bound + 1, float(bound)]
            for value in edges:
                obj = object.__new__(cls)
                obj.__dict__[name] = value
                problems = Problems()
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(ranges, "numeric_fields", lambda _cls, n=name, r=rng: ((n, r),))
                    ranges._bounds.cache_clear()
                    passed = ranges.check(obj, problems)
                ranges._bounds.cache_clear()
                assert passed == (rng.problem(value) is None), (cls.__name__, name, rng, value)


def test_out_of_range_defaults_are_still_reported():
    """`ranges.check` skips a field still holding its class default only when that default is
    in range: megatron-core's num_layers=0 must still be reported when the user leaves it."""
    from megatron_bridge.config import ranges
    from megatron_bridge.config.errors import Problems
    from megatron_bridge.models import GPTModelProvider

    provider = GPTModelProvider(hidden_size=64, num_attention_heads=4)
    problems = Problems()
    assert ranges.check(provider, problems) is False
    assert [str(p) for p in problems.items] == [
        "num_layers: 0 is outside the allowed range [1, 2**31) (choose a value in that range)"
    ]
    provider.num_layers = 2
    assert ranges.check(provider, Problems()) is True


# ---------------------------------------------------------------------- absurd magnitudes, environment variables
@pytest.mark.parametrize(
    "section, field, value, allowed",
    [
        ("optimizer", "min_lr", 1e30, "[0, 10]"), ("optimizer", "decoupled_lr", 11.0, "[0, 10]"),
        ("optimizer", "initial_loss_scale", 2.0**65, "(0, 2**64]"), ("optimizer", "loss_scale_window", 1e30, "[1, 2**31)"),
        ("model", "softmax_scale", 1e30, "(0, 100]"), ("model", "moe_aux_loss_coeff", 1e30, "[0, 100]"),
        ("model", "embedding_init_method_std", 1e30, "(0, 10]"), ("model", "rope_scaling_factor", 1e30, "(0, 1000]"),
        ("model", "moe_input_jitter_eps", 2.0, "[0, 1]"), ("scheduler", "end_weight_decay", 1e30, "[0, 10]"),
    ],
)  # fmt: skip
def test_absurd_magnitudes_are_outside_the_declared_ranges(section, field, value, allowed):
    cfg = tiny_config()
    setattr(getattr(cfg, section), field, value)
    assert f"{section}.{field}: {value!r} is outside the allowed range {allowed} (choose a value in that range)" in (
        problems_of(cfg)
    )


def test_validate_refuses_env_vars_that_load_code_and_sets_none_of_them(monkeypatch):
    monkeypatch.delenv("MB_TEST_FINE", raising=False)
    monkeypatch.delenv("PYTHONSTARTUP", raising=False)
    cfg = tiny_config()
    cfg.env_vars = {"MB_TEST_FINE": "1", "PYTHONSTARTUP": "/tmp/x.py", "GIT_CONFIG_KEY_0": "core.fsmonitor"}
    with pytest.raises(ConfigValidationError) as err:
        cfg.validate()
    assert "env_vars.PYTHONSTARTUP: may not be set from a config: Python runs this file at interactive start" in str(err.value)
    assert "env_vars.GIT_CONFIG_KEY_0: may not be set from a config: git takes settings" in str(err.value)
    problems_of(cfg)
    assert "MB_TEST_FINE" not in os.environ and "PYTHONSTARTUP" not in os.environ  # all of them, or none


# ---------------------------------------------------------------------- settings megatron-core would fail on mid-run
def test_hierarchical_context_parallel_sizes_need_a2a_p2p_also_without_cp_comm_type():
    cfg = tiny_config(model=tiny_model(hierarchical_context_parallel_sizes=[1, 1]))
    assert only_problem(cfg) == (
        "model.hierarchical_context_parallel_sizes: set to [1, 1] but cp_comm_type is None "
        "(use cp_comm_type='a2a+p2p' or unset hierarchical_context_parallel_sizes)"
    )


def test_half_precision_parameters_need_the_mixed_precision_optimizer():
    assert only_problem(tiny_config(model=tiny_model(params_dtype=torch.bfloat16))) == (
        "model.params_dtype: bfloat16 without model.bf16=True: the fp32 optimizer needs float32 parameters "
        "(use mixed_precision='bf16_mixed' (bf16 weights with fp32 main weights in the optimizer), or leave "
        "model.params_dtype at float32)"
    )
    assert only_problem(tiny_config(model=tiny_model(params_dtype=torch.float64))) == (
        "model.params_dtype: float64: megatron-core's optimizers train float32 parameters, or bf16/fp16 ones with "
        "mixed precision (use float32, or mixed_precision='bf16_mixed' / 'fp16_mixed')"
    )
    runtime_config_update(tiny_config(model=tiny_model(params_dtype=torch.bfloat16), mixed_precision="bf16_mixed"))


@pytest.mark.timeout(120)
def test_uninitialized_weights_need_a_checkpoint_to_load(tmp_path):
    from megatron_bridge.training.gpt_step import forward_step
    from megatron_bridge.training.pretrain import pretrain

    assert only_problem(tiny_config(model=tiny_model(perform_initialization=False))) == (
        "model.perform_initialization: False leaves the weights uninitialized (whatever memory held), and no "
        "checkpoint is loaded into them (set checkpoint.load or checkpoint.pretrained_checkpoint, or leave "
        "model.perform_initialization=True)"
    )
    # a load directory passes validation; the run finds it empty before training on garbage weights
    cfg = tiny_config(model=tiny_model(perform_initialization=False), checkpoint=CheckpointConfig(load=str(tmp_path)))
    cfg.train.train_iters = 1
    with pytest.raises(ConfigValidationError) as err:
        pretrain(cfg, forward_step)
    assert err.value.errors == [
        f"model.perform_initialization: False leaves the weights uninitialized, and checkpoint.load={str(tmp_path)!r} "
        "holds no checkpoint to load into them (point checkpoint.load at a saved run, or leave "
        "model.perform_initialization=True)"
    ]


def test_multi_latent_attention_needs_a_provider_with_its_sizes():
    assert only_problem(tiny_config(model=tiny_model(multi_latent_attention=True))) == (
        "model.multi_latent_attention: True needs the multi-latent attention sizes (q_lora_rank, kv_lora_rank, "
        "qk_head_dim, ...), which GPTModelProvider does not have (use a provider with them (DeepSeekModelProvider), "
        "or set model.multi_latent_attention=False)"
    )


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("hybrid_context_parallel", True, "megatron-core's hybrid context parallelism trains on the sub-sample batches"),
        ("max_seqlen_per_dp_cp_rank", 32, "megatron-core's hybrid context parallelism trains on the sub-sample batches"),
        ("qk_clip", True, "the training loop does not call megatron-core's clip_qk"),
        ("log_max_attention_logit", True, "the training loop does not call megatron-core's clip_qk"),
        ("heterogeneous_block_specs", True, "per-layer block configs"),
        ("use_kitchen", True, "NVIDIA Kitchen's quantized layers are not an integration here"),
        ("experimental_attention_variant", "dsa", "the model build uses megatron-core's GPT layer specs"),
        ("apply_residual_connection_post_layernorm", True, "megatron-core 0.16's transformer layer does not read it"),
    ],
)
def test_model_settings_the_run_does_not_implement_are_refused(field, value, reason):
    problem = only_problem(tiny_config(model=tiny_model(**{field: value})))
    assert problem.startswith(f"model.{field}: {field}={value!r} is not supported: not implemented: {reason}")


@pytest.mark.parametrize(
    "field", ["memory_efficient_layer_norm", "fused_single_qkv_rope", "moe_permute_fusion", "moe_router_fusion"]
)
def test_fused_kernel_settings_are_refused_on_cpu(field):
    model = tiny_model(num_moe_experts=4, moe_ffn_hidden_size=32, **{field: True})
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(tiny_config(model=model), device="cpu")
    assert err.value.errors == [
        f"model.{field}: True needs CUDA, but this run trains on CPU (set model.{field}=False or train on GPUs "
        "(dist.distributed_backend='nccl'))"
    ]


def test_settings_that_need_transformer_engine_are_machine_problems():
    from megatron_bridge.config.status import machine_problems

    runtime_config_update(tiny_config(model=tiny_model(cpu_offloading=True)))  # not a config error
    settings = dict(cpu_offloading=True, fused_single_qkv_rope=True, moe_permute_fusion=True, moe_router_fusion=True,
                    moe_latent_size=16)  # fmt: skip
    cfg = tiny_config(model=tiny_model(num_moe_experts=4, moe_ffn_hidden_size=32, **settings))
    with extras.assume_installed(transformer_engine=False):
        found = machine_problems(cfg, device="cuda")
    assert sorted(found) == sorted(
        f"model.{name}: {name}={value!r} needs TransformerEngine (pip install transformer-engine, or leave it unset)"
        for name, value in settings.items()
    )


def test_training_keeps_the_logits_split():
    assert only_problem(tiny_config(model=tiny_model(parallel_output=False))) == (
        "model.parallel_output: False gathers the logits over tensor-parallel ranks, and megatron-core's training "
        "loss (its vocabulary-parallel cross entropy) takes them split (with gathered logits it fails in the backward "
        "pass) (leave model.parallel_output=True for training (generation gathers the logits itself))"
    )


def test_attention_heads_must_split_into_the_query_groups():
    """megatron-core's config takes 4 heads in 3 groups; its attention fails at the first forward."""
    assert only_problem(tiny_config(model=tiny_model(num_query_groups=3))) == (
        "model.num_query_groups: 3 query groups do not divide num_attention_heads=4 (megatron-core fails on it at "
        "the first forward pass) (choose num_query_groups that divides num_attention_heads)"
    )
    runtime_config_update(tiny_config(model=tiny_model(num_query_groups=2)))


def test_expert_settings_megatron_core_fails_on_at_the_build():
    moe = dict(num_moe_experts=4, moe_ffn_hidden_size=32)
    assert only_problem(tiny_config(model=tiny_model(moe_token_dispatcher_type="flex", **moe))) == (
        "model.moe_token_dispatcher_type: 'flex' dispatches over the expert tensor- and expert-parallel ranks "
        "together, and there is one (expert_tensor_parallel_size=1, expert_model_parallel_size=1) (use 'alltoall' or "
        "'allgather', or raise expert_model_parallel_size)"
    )
    with pytest.raises(ConfigValidationError) as err:
        cfg = tiny_config(model=tiny_model(moe_token_dispatcher_type="flex", expert_model_parallel_size=2, **moe))
        runtime_config_update(cfg, world_size=2, device="cpu")
    assert err.value.errors == [
        "model.moe_token_dispatcher_type: 'flex' dispatches through DeepEP or HybridEP kernels, which need CUDA, but "
        "this run trains on CPU (use 'alltoall' or 'allgather' on CPU)"
    ]
    assert only_problem(tiny_config(model=tiny_model(moe_router_topk=5, **moe))) == (
        "model.moe_router_topk: 5 experts per token, but the model has num_moe_experts=4 (the router's top-k fails "
        "at the first forward pass) (set model.moe_router_topk to at most 4)"
    )
    assert only_problem(tiny_config(model=tiny_model(moe_layer_freq=[1, 0, 1], **moe))) == (
        "model.moe_layer_freq: lists 3 layers, the model has num_layers=2 (megatron-core fails on it at the model "
        "build) (give one 0/1 per layer (1: a mixture-of-experts layer), or an int N (every Nth layer))"
    )
    runtime_config_update(tiny_config(model=tiny_model(moe_layer_freq=[0, 1], **moe)))
    assert only_problem(tiny_config(model=tiny_model(moe_apply_probs_on_input=True, **moe))) == (
        "model.moe_apply_probs_on_input: megatron-core applies the routing probability to the expert input only with "
        "one expert per token, but moe_router_topk=2 (set model.moe_router_topk=1, or "
        "model.moe_apply_probs_on_input=False)"
    )


def test_shared_experts_have_no_biases():
    cfg = tiny_config(model=tiny_model(num_moe_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32))
    assert only_problem(cfg) == (
        "model.moe_shared_expert_intermediate_size: megatron-core's shared experts have no biases, but "
        "add_bias_linear=True (set model.add_bias_linear=False, or leave model.moe_shared_expert_intermediate_size unset)"
    )


def test_mlp_recompute_needs_mlps_without_biases():
    cfg = tiny_config(model=tiny_model(recompute_granularity="selective", recompute_modules=["mlp"]))
    assert only_problem(cfg) == (
        "model.recompute_modules: 'mlp' recomputes the dense MLPs, and megatron-core's MLP recompute fails with their "
        "biases (add_bias_linear=True): the backward pass recurses without end (set model.add_bias_linear=False, or "
        "leave 'mlp' out of model.recompute_modules)"
    )
    all_experts = tiny_model(recompute_granularity="selective", recompute_modules=["mlp"], num_moe_experts=4, moe_ffn_hidden_size=32)
    runtime_config_update(tiny_config(model=all_experts))  # megatron-core recomputes no MoE layer's MLP


def test_external_dataloader_needs_a_dataset_of_micro_batches():
    cfg = tiny_config(dataset=MockGPTDatasetConfig(seq_length=32, num_workers=0, dataloader_type="external"))
    assert only_problem(cfg) == (
        "dataset.dataloader_type: 'external' takes the dataset as an iterator of micro batches (what a "
        "DatasetProvider's build_datasets may return), but MockGPTDatasetConfig builds datasets of single samples "
        "(use 'single', 'cyclic' or 'batch', or leave dataset.dataloader_type unset)"
    )


def test_optimizer_offload_is_refused_on_cpu():
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(tiny_config(optimizer=OptimizerConfig(lr=1e-3, optimizer_cpu_offload=True)), device="cpu")
    assert err.value.errors == [
        "optimizer.optimizer_cpu_offload: megatron-core's hybrid optimizer moves optimizer state from the GPUs to host "
        "memory, and this run trains on CPU (where it fails at the first step) (set optimizer.optimizer_cpu_offload="
        "False on CPU (the optimizer state is in host memory already))"
    ]


def test_precision_aware_optimizer_needs_transformer_engine():
    opt = OptimizerConfig(lr=1e-3, use_precision_aware_optimizer=True, use_distributed_optimizer=True)
    cfg = tiny_config(optimizer=opt)
    cfg.ddp.use_distributed_optimizer = True
    with extras.assume_installed(transformer_engine=False):
        assert only_problem(cfg) == (
            "optimizer.use_precision_aware_optimizer: the precision-aware optimizer (TransformerEngine's FusedAdam) "
            "needs the 'transformer_engine' package (pip install 'megatron-bridge[te]')"
        )


def test_distributed_optimizer_instances_split_the_data_parallel_ranks():
    cfg = tiny_config(optimizer=OptimizerConfig(lr=1e-3, use_distributed_optimizer=True))
    cfg.ddp.use_distributed_optimizer = True
    cfg.ddp.num_distributed_optimizer_instances = 2
    assert only_problem(cfg) == (
        "ddp.num_distributed_optimizer_instances: 2 instances do not split the DP x CP = 1 ranks evenly "
        "(choose a number of instances that divides DP x CP)"
    )


def test_distributed_optimizer_instances_need_the_distributed_optimizer():
    """Several instances are several distributed optimizers; without one, megatron-core all-reduces
    the gradients as usual, only without overlapping it."""
    cfg = tiny_config(ddp=DistributedDataParallelConfig(num_distributed_optimizer_instances=2))
    assert only_problem(cfg, world_size=4) == (
        "ddp.num_distributed_optimizer_instances: 2 instances of the distributed optimizer, but it is off "
        "(ddp.use_distributed_optimizer=False) (set ddp.use_distributed_optimizer=True, or leave "
        "ddp.num_distributed_optimizer_instances at 1)"
    )
    runtime_config_update(
        tiny_config(ddp=DistributedDataParallelConfig(num_distributed_optimizer_instances=2, use_distributed_optimizer=True)),
        world_size=4,
    )


def test_overlapped_parameter_gather_needs_the_distributed_optimizer():
    """Only the distributed optimizer gathers parameters: megatron-core reads overlap_param_gather only with it."""
    cfg = tiny_config(ddp=DistributedDataParallelConfig(overlap_param_gather=True, overlap_grad_reduce=True))
    assert only_problem(cfg, world_size=2) == (
        "ddp.overlap_param_gather: True overlaps the distributed optimizer's parameter all-gather, and the "
        "distributed optimizer is off (megatron-core ignores it then) (set ddp.use_distributed_optimizer=True, or "
        "turn overlap_param_gather off)"
    )
    from megatron_bridge.training.comm_overlap import CommOverlapConfig

    asked = tiny_config(comm_overlap=CommOverlapConfig(overlap_param_gather=True))
    assert only_problem(asked, world_size=2).startswith("ddp.overlap_param_gather: True overlaps")
    on = DistributedDataParallelConfig(overlap_param_gather=True, overlap_grad_reduce=True, use_distributed_optimizer=True)
    runtime_config_update(tiny_config(ddp=on), world_size=2)


def test_overlapped_p2p_with_batched_p2p_is_refused_with_interleaved_pipelining():
    """megatron-core's interleaved schedule raises on the two together at the first step; the
    communication-overlap preset turns batching off when it turns the overlap on."""
    from megatron_bridge.training.comm_overlap import CommOverlapConfig

    layout = dict(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert only_problem(tiny_config(model=tiny_model(overlap_p2p_comm=True, **layout)), world_size=2) == (
        "model.overlap_p2p_comm: True with batch_p2p_comm=True: megatron-core's interleaved pipeline schedule "
        "refuses the two together (at the first training step) (set model.batch_p2p_comm=False, or "
        "model.overlap_p2p_comm=False)"
    )
    preset = tiny_config(model=tiny_model(**layout), comm_overlap=CommOverlapConfig(overlap_p2p_comm=True))
    runtime_config_update(preset, world_size=2)
    assert (preset.model.overlap_p2p_comm, preset.model.batch_p2p_comm) == (True, False)


def test_nccl_user_buffers_are_refused_on_cpu():
    cfg = tiny_config()
    cfg.ddp.nccl_ub = True
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg, device="cpu")
    assert err.value.errors == [
        "ddp.nccl_ub: NCCL user buffers are an NCCL setting, and this run trains on CPU with gloo "
        "(leave ddp.nccl_ub unset on CPU)"
    ]


def test_autocast_is_refused_on_cpu():
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(tiny_config(model=tiny_model(enable_autocast=True, autocast_dtype=torch.bfloat16)), device="cpu")
    assert err.value.errors == [
        "model.enable_autocast: megatron-core autocasts the forward pass with torch.autocast('cuda'), which leaves CPU "
        "computation in its own dtype, and this run trains on CPU (leave model.enable_autocast unset on CPU "
        "(mixed_precision='bf16_mixed' trains in bf16 there))"
    ]


@pytest.mark.parametrize(
    "mixed_precision, fields, text",
    [
        (None, {"loss_scale": 128.0}, "optimizer.loss_scale: 128.0 has no effect in an fp32 run (megatron-core "
         "scales the loss only with fp16 or bf16) (use a mixed_precision preset (e.g. fp16_mixed), or remove "
         "optimizer.loss_scale)"),
        ("bf16_mixed", {"hysteresis": 4}, "optimizer.hysteresis: 4 has no effect: dynamic loss scaling is fp16's "
         "alone (leave optimizer.hysteresis at 2)"),
        ("fp16_mixed", {"loss_scale": 8.0, "min_loss_scale": 2.0}, "optimizer.min_loss_scale: 2.0 has no effect: a "
         "constant loss_scale is set (leave optimizer.min_loss_scale at 1.0)"),
    ],
)  # fmt: skip
def test_loss_scaling_settings_the_run_would_not_use_are_refused(mixed_precision, fields, text):
    cfg = tiny_config(mixed_precision=mixed_precision)
    for name, value in fields.items():
        setattr(cfg.optimizer, name, value)
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg, device="cpu")
    assert err.value.errors == [text]


def test_dynamic_loss_scaling_settings_are_accepted_in_fp16():
    cfg = tiny_config(mixed_precision="fp16_mixed")
    cfg.optimizer.hysteresis, cfg.optimizer.initial_loss_scale = 4, 2.0**16
    runtime_config_update(cfg, device="cpu")
    assert (cfg.optimizer.fp16, cfg.optimizer.hysteresis, cfg.optimizer.initial_loss_scale) == (True, 4, 2.0**16)


def test_symmetric_all_reduce_needs_transformer_engine():
    with extras.assume_installed(transformer_engine=False):
        assert only_problem(tiny_config(model=tiny_model(symmetric_ar_type="two_shot"))) == (
            "model.symmetric_ar_type: symmetric-memory all-reduce needs the 'transformer_engine' package "
            "(pip install 'megatron-bridge[te]')"
        )


@pytest.mark.parametrize(
    "fields, text",
    [
        ({"rope_scaling_factor": 16.0}, "model.rope_scaling_factor: 16.0 has no effect without Llama 3.1's rope scaling "
         "(model.rope_scaling=True: megatron-core reads it only then) (set model.rope_scaling=True, or leave model.rope_scaling_factor at 8.0)"),
        ({"mtp_loss_scaling_factor": 0.3}, "model.mtp_loss_scaling_factor: 0.3 has no effect without multi-token "
         "prediction (model.mtp_num_layers: megatron-core reads it only then) (set model.mtp_num_layers, or leave "
         "model.mtp_loss_scaling_factor at 0.1)"),
        ({"num_moe_experts": 4, "moe_router_topk": 2, "moe_shared_expert_gate": True}, "model.moe_shared_expert_gate: "
         "True has no effect without shared experts (model.moe_shared_expert_intermediate_size: megatron-core reads "
         "it only then) (set "
         "model.moe_shared_expert_intermediate_size, or leave model.moe_shared_expert_gate at False)"),
        ({"moe_ffn_hidden_size": 32}, "model.moe_ffn_hidden_size: 32 has no effect without experts "
         "(model.num_moe_experts: megatron-core reads it only then) (set model.num_moe_experts, or leave "
         "model.moe_ffn_hidden_size at None)"),
        ({"cpu_offloading_weights": True}, "model.cpu_offloading_weights: True has no effect without layer "
         "offloading (model.cpu_offloading=True: megatron-core reads it only then) (set model.cpu_offloading=True, "
         "or leave model.cpu_offloading_weights at False)"),
    ],
)  # fmt: skip
def test_a_field_whose_feature_is_off_is_refused(fields, text):
    from factories import tiny_llama_model

    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(tiny_config(model=tiny_llama_model(**fields)))
    assert text in err.value.errors


def test_shared_experts_without_experts_are_refused():
    """megatron-core builds shared experts only in a mixture-of-experts layer; a dense model ignored the size."""
    assert only_problem(tiny_config(model=tiny_model(moe_shared_expert_intermediate_size=32))) == (
        "model.moe_shared_expert_intermediate_size: 32 has no effect without experts (model.num_moe_experts: "
        "megatron-core reads it only then) (set model.num_moe_experts, or leave "
        "model.moe_shared_expert_intermediate_size at None)"
    )


def test_a_field_whose_feature_is_on_is_accepted():
    from factories import tiny_llama_model

    cfg = tiny_config(model=tiny_llama_model(rope_scaling=True, rope_scaling_factor=16.0, mtp_num_layers=1,
                                             mtp_loss_scaling_factor=0.3))  # fmt: skip
    runtime_config_update(cfg)
    assert cfg.model.rope_scaling_factor == 16.0 and cfg.model.mtp_loss_scaling_factor == 0.3
