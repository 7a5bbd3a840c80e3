"""The PyTorch profiler over a window of steps (CPU traces), and the GPU-only tools refused on CPU."""

import glob
import json

import pytest
import torch
from factories import tiny_config

from megatron_bridge.config.errors import Problems
from megatron_bridge.runtime import cpu_backend
from megatron_bridge.training.config import (
    ConfigValidationError,
    ProfilingConfig,
    TrainingConfig,
    ValidationConfig,
    runtime_config_update,
)
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain
from megatron_bridge.training.profiling import StepProfiler, default_profile_dir


def profiled_steps(trace_dir):
    (path,) = glob.glob(f"{trace_dir}/rank0.*.pt.trace.json")
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    # on a GPU each step is also annotated on the GPU's timeline (category gpu_user_annotation)
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and not e.get("cat", "").startswith("gpu")]
    return sorted(e["name"] for e in steps)


@pytest.mark.timeout(300)
def test_trace_covers_the_requested_steps(tmp_path, caplog):
    cfg = tiny_config(
        train=TrainingConfig(train_iters=5, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_iters=0),
        profiling=ProfilingConfig(
            use_pytorch_profiler=True, profile_step_start=2, profile_step_end=4, profile_dir=str(tmp_path / "prof")
        ),
    )
    with caplog.at_level("INFO", logger="megatron_bridge"):
        pretrain(cfg, forward_step)
    # iterations 2 and 3 (the 1st one warms the profiler up)
    assert len(profiled_steps(tmp_path / "prof")) == 2
    assert f"PyTorch profiler trace written to {tmp_path / 'prof'}" in caplog.text


def work():
    a = torch.randn(64, 64)
    return (a @ a).relu().sum()


def test_window_from_the_first_iteration_and_an_early_stop(tmp_path):
    cfg = tiny_config(
        profiling=ProfilingConfig(
            use_pytorch_profiler=True, profile_step_start=1, profile_step_end=3, profile_dir=str(tmp_path / "a")
        )
    )
    profiler = StepProfiler(cfg, rank=0, device="cpu")
    for completed in range(4):
        profiler.step_start(completed)
        work()
        profiler.step_end(completed + 1)
    profiler.close()
    assert len(profiled_steps(tmp_path / "a")) == 2

    # training stops inside the window: the steps recorded so far are written
    # (iteration 1 warms up, 2..4 are recorded, training ends after 4 of the window 2..9)
    cfg.profiling.profile_step_start, cfg.profiling.profile_step_end = 2, 10
    cfg.profiling.profile_dir = str(tmp_path / "b")
    profiler = StepProfiler(cfg, rank=0, device="cpu")
    for completed in range(4):
        profiler.step_start(completed)
        work()
        profiler.step_end(completed + 1)
    profiler.close()
    steps = profiled_steps(tmp_path / "b")  # the step opened by the last step_end is in it, empty
    assert steps[:3] == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"] and "ProfilerStep#0" not in steps


def test_ranks_outside_profile_ranks_do_not_profile(tmp_path):
    cfg = tiny_config(
        profiling=ProfilingConfig(
            use_pytorch_profiler=True,
            profile_step_start=1,
            profile_step_end=2,
            profile_ranks=[1],
            profile_dir=str(tmp_path),
        )
    )
    profiler = StepProfiler(cfg, rank=0, device="cpu")
    profiler.step_start(0)
    profiler.step_end(1)
    profiler.close()
    assert not profiler.enabled and not list(tmp_path.iterdir())


def test_default_profile_dir():
    cfg = tiny_config()
    assert default_profile_dir(cfg) == "./profile"
    cfg.checkpoint.save = "/ckpt"
    assert default_profile_dir(cfg) == "/ckpt/profile"
    cfg.logger.tensorboard_dir = "/tb"
    assert default_profile_dir(cfg) == "/tb/profile"


@pytest.mark.parametrize(
    "field, what",
    [
        ("use_nsys_profiler", "Nsight Systems profiling"),
        ("record_memory_history", "CUDA memory history"),
        ("nvtx_ranges", "NVTX ranges"),
    ],
)
def test_gpu_only_profiling_is_a_config_error_on_cpu(field, what):
    cfg = tiny_config(profiling=ProfilingConfig(**{field: True}))
    problems = Problems()
    cpu_backend.adapt_config(cfg, problems)
    message = (
        f"profiling.{field}: {what} needs a CUDA GPU, but this run trains on CPU "
        f"(set profiling.{field}=False; profiling.use_pytorch_profiler=True records CPU traces)"
    )
    assert [str(p) for p in problems.items] == [message]


@pytest.mark.parametrize(
    "window, world_size, message",
    [
        (
            dict(),  # the default window (10 to 11) in a 5-iteration run
            1,
            "profiling.profile_step_start: the profiled iterations start at 10, after the run's last iteration (5) "
            "(set profiling.profile_step_start and profile_step_end within the run, e.g. 1 and 3)",
        ),
        (
            dict(profile_step_start=0, profile_step_end=1),  # Megatron-LM counts from 0, the console from 1
            1,
            "profiling.profile_step_end: iterations 0 to 0 hold none of the run's (they are numbered from 1, as the "
            "console shows them) (set profiling.profile_step_end to 2 or more (start=1, end=2 profiles the first "
            "iteration))",
        ),
        (
            dict(profile_step_start=1, profile_step_end=3, profile_ranks=[2, 3]),
            2,
            "profiling.profile_ranks: none of [2, 3] is a rank of this 2-process run (use ranks from 0 to 1)",
        ),
    ],
)
def test_a_profiler_that_would_record_nothing_is_a_config_error(window, world_size, message):
    from megatron_bridge.training.config import ConfigValidationError, runtime_config_update

    cfg = tiny_config(
        train=TrainingConfig(train_iters=5, global_batch_size=8, micro_batch_size=2),
        profiling=ProfilingConfig(use_pytorch_profiler=True, **window),
    )
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg, world_size=world_size)
    assert err.value.errors == [message]
    cfg.profiling.profile_step_start, cfg.profiling.profile_step_end, cfg.profiling.profile_ranks = 5, 6, [0, 3]
    runtime_config_update(cfg, world_size=world_size)  # the last iteration, on a rank that exists


def test_profiler_settings_without_a_profiler_are_refused():
    cfg = tiny_config(profiling=ProfilingConfig(profile_step_start=2, profile_step_end=4, record_shapes=True))
    with pytest.raises(ConfigValidationError) as err:
        runtime_config_update(cfg)
    any_profiler = "profiling.use_pytorch_profiler or profiling.use_nsys_profiler or profiling.record_memory_history"
    assert err.value.errors == [
        f"profiling.profile_step_start: 2 has no effect: no profiler that reads it is on ({any_profiler}) "
        f"(turn on {any_profiler}, or remove profiling.profile_step_start)",
        f"profiling.profile_step_end: 4 has no effect: no profiler that reads it is on ({any_profiler}) "
        f"(turn on {any_profiler}, or remove profiling.profile_step_end)",
        "profiling.record_shapes: True has no effect: no profiler that reads it is on (profiling.use_pytorch_profiler "
        "or profiling.use_nsys_profiler) (turn on profiling.use_pytorch_profiler or profiling.use_nsys_profiler, or "
        "remove profiling.record_shapes)",
    ]
    cfg.profiling.use_pytorch_profiler = True
    runtime_config_update(cfg)

