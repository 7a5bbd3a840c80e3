"""The CPU backend: what it replaces, that it restores exactly, and that it stays off with CUDA
unless the run trains on CPU (activated for "cpu", it works on every machine)."""

import pytest
import torch
from factories import tiny_config, tiny_model

from megatron_bridge.config.errors import ConfigValidationError, Problems
from megatron_bridge.runtime import cpu_backend


@pytest.fixture(autouse=True)
def always_inactive():
    assert not cpu_backend.is_active()
    yield
    cpu_backend.deactivate()


def test_activate_then_deactivate_restores_exactly():
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils

    before_cuda = {name: getattr(torch.cuda, name, None) for name in cpu_backend.CUDA_STAND_INS}
    before_tracker = mrandom.CudaRNGStatesTracker
    before_rng = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    before_masks = (utils.get_default_causal_mask, fused_softmax.get_default_causal_mask)
    assert cpu_backend.activate("cpu") is True
    assert torch.cuda.current_device() == "cpu"
    assert mrandom.CudaRNGStatesTracker is not before_tracker
    assert mrandom._get_cuda_rng_state is not before_rng[0]
    # built on "cuda" by megatron-core, also where recompute runs it inside backward()
    assert fused_softmax.get_default_causal_mask(4).device.type == "cpu"
    cpu_backend.deactivate()
    assert {name: getattr(torch.cuda, name, None) for name in cpu_backend.CUDA_STAND_INS} == before_cuda
    assert mrandom.CudaRNGStatesTracker is before_tracker
    assert (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state) == before_rng
    assert (utils.get_default_causal_mask, fused_softmax.get_default_causal_mask) == before_masks


def test_never_activates_where_cuda_is_available(monkeypatch):
    # No GPU here: pretend one exists to check the backend stays out of the way.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    original = torch.cuda.synchronize
    assert cpu_backend.activate() is False
    assert not cpu_backend.is_active() and torch.cuda.synchronize is original


def test_cuda_device_arguments_run_on_cpu_while_active():
    with cpu_backend.active("cpu"):
        a = torch.zeros(3, device="cuda")
        b = torch.ones(2, device=torch.device("cuda", 0)).cuda()
        c = torch.arange(4).to("cuda")
        d = torch.empty(1, device=torch.cuda.current_device())
        assert {t.device.type for t in (a, b, c, d)} == {"cpu"}
        assert torch.randn(2).type() == "torch.cuda.FloatTensor"  # megatron asserts this type
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.synchronize()
    assert torch.randn(2).type() == "torch.FloatTensor"


@pytest.mark.parametrize("gpu_machine", [True, False], ids=["gpu-machine", "cpu-machine"])
def test_compiled_functions_run_as_written_only_in_a_cpu_run_on_a_gpu_machine(monkeypatch, gpu_machine):
    """On a GPU machine, torch.compile's code generation asked the stand-in current_device() for
    GPU properties ("Expected a cuda device, but got: cpu", DeepSeek-V3's expert-bias update in a
    2-process gloo run); there the compiled functions run eagerly while the backend is active."""
    compiled = []

    def backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    fn = torch.compile(lambda x: x * 2 + 1, backend=backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu_machine)
    with cpu_backend.active("cpu"):
        assert torch.equal(fn(torch.ones(2)), torch.full((2,), 3.0))
    assert len(compiled) == (0 if gpu_machine else 1)
    monkeypatch.undo()
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0))  # compiled again once inactive
    assert len(compiled) >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour: without a GPU, CUDA tensors fail")
def test_cuda_device_arguments_fail_again_after_deactivation():
    with cpu_backend.active():
        torch.zeros(1, device="cuda")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_rng_tracker_forks_cpu_generator_states():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with cpu_backend.active("cpu"):
        tracker = get_cuda_rng_tracker()
        tracker.add("stream-a", 123)
        torch.manual_seed(0)
        outside = torch.get_rng_state()
        with tracker.fork("stream-a"):
            first = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), outside)  # the default stream is untouched
        with tracker.fork("stream-a"):
            second = torch.rand(3)
        assert not torch.equal(first, second)  # the named stream advanced
        torch.manual_seed(123)
        assert torch.equal(torch.rand(3), first)


def test_adapt_config_turns_off_cuda_only_settings_and_keeps_user_choices():
    cfg = tiny_config(model=tiny_model(transformer_impl="transformer_engine"))
    problems = Problems()
    cpu_backend.adapt_config(cfg, problems)
    assert [str(p) for p in problems] == [
        "model.transformer_impl: 'transformer_engine' needs CUDA, but this run trains on CPU "
        "(set model.transformer_impl='local' or train on GPUs (dist.distributed_backend='nccl'))"
    ]
    default = tiny_config(model=tiny_model(transformer_impl="transformer_engine"))
    default.model.mark_explicit("transformer_impl", False)
    changed = cpu_backend.adapt_config(default, Problems())
    assert "model.transformer_impl='local'" in changed and "model.use_cpu_initialization=True" in changed
    assert default.model.transformer_impl == "local" and not default.model.is_explicit("transformer_impl")


def test_sequence_parallel_and_determinism_stats_are_refused_on_cpu():
    from megatron_bridge.training.setup import resolve_config

    cfg = tiny_config(model=tiny_model(tensor_model_parallel_size=2, sequence_parallel=True))
    cfg.dist.distributed_backend = "gloo"  # a CPU run, also where GPUs are visible
    cfg.rerun_state_machine.rerun_mode = "report_determinism_stats"
    with pytest.raises(ConfigValidationError) as err:
        resolve_config(cfg)
    assert any(e.startswith("model.sequence_parallel: sequence parallelism does not run") for e in err.value.errors)
    assert any("'report_determinism_stats' fails on CPU" in e for e in err.value.errors)


def test_cpu_threads_honour_omp_num_threads_else_share_the_cores(monkeypatch):
    import os

    from megatron_bridge.runtime.distributed import cpu_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(world_size=2) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_threads(world_size=4) == max(1, (os.cpu_count() or 1) // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cpu_threads(world_size=1) == (os.cpu_count() or 1)


def test_pin_memory_is_turned_off_on_cpu_unless_the_user_asked_for_it():
    default = tiny_config()
    assert default.dataset.pin_memory and not default.dataset.is_explicit("pin_memory")
    changed = cpu_backend.adapt_config(default, Problems())
    assert "dataset.pin_memory=False" in changed and default.dataset.pin_memory is False
    chosen = tiny_config()
    chosen.dataset.pin_memory = True  # torch skips pinning without CUDA (with a warning); the choice is kept
    problems = Problems()
    assert "dataset.pin_memory=False" not in cpu_backend.adapt_config(chosen, problems)
    assert chosen.dataset.pin_memory is True and not problems
