"""Training on CPUs: stand-ins for the CUDA-only calls megatron-core makes.

megatron-core assumes CUDA in many places: `torch.cuda.current_device()` as a device, tensors
created with `device="cuda"` or `.cuda()`, CUDA streams/events, the CUDA RNG tracker, and asserts
that gradients are `torch.cuda.FloatTensor`. `activate()` makes these work on CPU:

1. an RNG-states tracker that keeps named CPU generator states (same streams as megatron's),
   and CPU versions of the "CUDA RNG state" that activation recompute saves and restores;
2. CPU stand-ins for the `torch.cuda` functions on the training and checkpoint paths (no-op
   synchronize/streams/events, RNG state of the CPU generator, zero memory statistics);
3. a `TorchFunctionMode`, entered on the activating thread, that turns CUDA device arguments into
   "cpu", makes `Tensor.cuda()` a no-op, and reports `torch.cuda.*` tensor types. A mode is off
   while it handles a call, so inside `backward()` too; the attention masks that activation
   recompute builds there on "cuda" are made under a mode of their own.

It is activated when a run trains on CPU: always where no GPU is visible, and on a machine with
GPUs when the run asks for CPU (`dist.distributed_backend=gloo`); then `torch.cuda.is_available()`
and `device_count()` report no GPU, so megatron-core takes its CPU paths. `deactivate()` restores
exactly what `activate()` replaced.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from megatron_bridge.config.rules import set_unless_user_set

logger = logging.getLogger(__name__)

_MISSING = object()


# ---------------------------------------------------------------------- RNG tracker
def _cpu_tracker_class(base: type) -> type:
    class CPURNGStatesTracker(base):
        """megatron's RNG-states tracker over the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            original = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original = torch.get_rng_state()
            original_name = self._current_state_name
            if original_name != "default-rng":
                self.states_[original_name] = original
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if original_name != "default-rng":
                    original = self.states_[original_name]
                torch.set_rng_state(original)
                self._current_state_name = original_name

    CPURNGStatesTracker.__qualname__ = CPURNGStatesTracker.__name__
    return CPURNGStatesTracker


# ---------------------------------------------------------------------- torch.cuda stand-ins
class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> "_Event":
        return _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _returning(value: Any, name: str) -> Callable[..., Any]:
    # A distinct function object per name: torch._dynamo keys its rules by torch.cuda's function
    # objects and rejects one object registered under two names.
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return value() if callable(value) else value

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in


def _set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(state)


CUDA_STAND_INS: dict[str, Callable[..., Any]] = {
    "current_device": _returning("cpu", "current_device"),  # used as `device=` by megatron
    "synchronize": _returning(None, "synchronize"),
    "set_device": _returning(None, "set_device"),
    "Stream": _Stream,
    "Event": _Event,
    "stream": _returning(contextlib.nullcontext, "stream"),
    "current_stream": _returning(_Stream, "current_stream"),
    "default_stream": _returning(_Stream, "default_stream"),
    "set_stream": _returning(None, "set_stream"),
    "get_rng_state": _returning(torch.get_rng_state, "get_rng_state"),
    "set_rng_state": _set_rng_state,
    "is_available": _returning(False, "is_available"),  # a CPU run on a GPU machine: no GPU for megatron-core
    "device_count": _returning(0, "device_count"),
    "memory_stats": _returning(dict, "memory_stats"),
    "memory_allocated": _returning(0, "memory_allocated"),
    "max_memory_allocated": _returning(0, "max_memory_allocated"),
    "memory_reserved": _returning(0, "memory_reserved"),
    "max_memory_reserved": _returning(0, "max_memory_reserved"),
    "reset_peak_memory_stats": _returning(None, "reset_peak_memory_stats"),
    "reset_max_memory_allocated": _returning(None, "reset_max_memory_allocated"),
    "empty_cache": _returning(None, "empty_cache"),
}
"""`torch.cuda` attributes replaced while the backend is active."""


# ---------------------------------------------------------------------- device remapping
def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # a bare CUDA ordinal


class CudaToCpuMode(TorchFunctionMode):
    """Turns CUDA device arguments into "cpu" for every torch call made while it is active."""

    _special = frozenset({torch.Tensor.cuda, torch.Tensor.to, torch.Tensor.type})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_cuda(device):
                kwargs = dict(kwargs, device="cpu")
        else:
            kwargs = {}
        if func in self._special:
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to:
                if len(args) > 1 and _is_cuda(args[1]):
                    args = (args[0], "cpu", *args[2:])
            elif not kwargs and len(args) == 1:  # Tensor.type(): megatron asserts torch.cuda.* types
                name = func(*args)
                return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return func(*args, **kwargs)


_MASK_MODULES = ("megatron.core.transformer.utils", "megatron.core.fusions.fused_softmax")
_MASK_FUNCTIONS = ("get_default_causal_mask", "get_sliding_window_causal_mask")
"""megatron-core's mask builders, which create their masks on "cuda" (also during the recompute
in a backward pass, where the activating thread's mode is off)."""


def _under_cpu_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        with CudaToCpuMode():
            return fn(*args, **kwargs)

    on_cpu.__name__ = on_cpu.__qualname__ = getattr(fn, "__name__", "on_cpu")
    return on_cpu


# ---------------------------------------------------------------------- activation
class _Backend:
    def __init__(self) -> None:
        self.active = False
        self.saved_cuda: dict[str, Any] = {}
        self.saved_random: dict[str, Any] = {}
        self.saved_masks: list[tuple[Any, str, Any]] = []
        self.mode: Optional[CudaToCpuMode] = None
        self.thread: Optional[int] = None
        self.eager: Any = None  # the compiler stance set while active on a GPU machine


_BACKEND = _Backend()


def needed() -> bool:
    """True where megatron-core needs the stand-ins: no usable CUDA device."""
    return not torch.cuda.is_available()


def is_active() -> bool:
    return _BACKEND.active


def activate(device: Optional[str] = None) -> bool:
    """Install the CPU stand-ins. `device` is the device the caller trains on: "cpu" activates
    even where CUDA is available (a gloo run on a GPU machine), "cuda" never does, and None
    activates only where no GPU is visible. A no-op when already active.

    Returns whether this call activated the backend.
    """
    if _BACKEND.active or device == "cuda" or (device is None and not needed()):
        return False
    from megatron.core.tensor_parallel import random as mrandom

    b = _BACKEND
    b.saved_random = {
        "CudaRNGStatesTracker": mrandom.CudaRNGStatesTracker,
        "_CUDA_RNG_STATE_TRACKER": mrandom._CUDA_RNG_STATE_TRACKER,
        "_CUDA_RNG_STATE_TRACKER_INITIALIZED": mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        "_get_cuda_rng_state": mrandom._get_cuda_rng_state,
        "_set_cuda_rng_state": mrandom._set_cuda_rng_state,
    }
    mrandom.CudaRNGStatesTracker = _cpu_tracker_class(mrandom.CudaRNGStatesTracker)
    # Recompute saves and restores the CPU generator itself; there is no CUDA generator.
    mrandom._get_cuda_rng_state = _returning(torch.get_rng_state, "_get_cuda_rng_state")
    mrandom._set_cuda_rng_state = _returning(None, "_set_cuda_rng_state")
    b.saved_masks = []
    for module in _MASK_MODULES:
        owner = importlib.import_module(module)
        for name in _MASK_FUNCTIONS:
            if hasattr(owner, name):
                original = getattr(owner, name)
                b.saved_masks.append((owner, name, original))
                setattr(owner, name, _under_cpu_mode(original))
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False

    if torch.cuda.is_available():
        # A CPU run on a GPU machine: torch.compile's code generation (megatron-core compiles
        # its MoE expert-bias update and fused activations) still sees the GPU and asks the
        # stand-in current_device() for its properties. The compiled functions run as written.
        b.eager = torch.compiler.set_stance("force_eager")
    b.saved_cuda = {name: getattr(torch.cuda, name, _MISSING) for name in CUDA_STAND_INS}
    for name, stand_in in CUDA_STAND_INS.items():
        setattr(torch.cuda, name, stand_in)

    b.mode = CudaToCpuMode()
    b.mode.__enter__()
    b.thread = threading.get_ident()
    b.active = True
    logger.info("CPU backend active: CUDA calls of megatron-core run on the CPU")
    return True


def deactivate() -> None:
    """Restore everything `activate()` replaced (call on the thread that activated)."""
    b = _BACKEND
    if not b.active:
        return
    if b.mode is not None:
        if threading.get_ident() != b.thread:
            raise RuntimeError("the CPU backend must be deactivated on the thread that activated it")
        b.mode.__exit__(None, None, None)
        b.mode = None
    for name, original in b.saved_cuda.items():
        if original is _MISSING:
            delattr(torch.cuda, name)
        else:
            setattr(torch.cuda, name, original)
    from megatron.core.tensor_parallel import random as mrandom

    for name, original in b.saved_random.items():
        setattr(mrandom, name, original)
    for owner, name, original in b.saved_masks:
        setattr(owner, name, original)
    b.saved_masks = []
    b.saved_cuda, b.saved_random = {}, {}
    if b.eager is not None:
        b.eager.__exit__(None, None, None)  # back to the stance from before activate()
        b.eager = None
    b.active = False


@contextlib.contextmanager
def active(device: Optional[str] = None):
    """Context manager: the CPU backend is active inside (as `activate(device)` decides)."""
    activated = activate(device)
    try:
        yield
    finally:
        if activated:
            deactivate()


# ---------------------------------------------------------------------- config on CPU
CPU_MODEL_SETTINGS = {
    "use_cpu_initialization": True,
    "gradient_accumulation_fusion": False,
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
    "memory_efficient_layer_norm": False,
    "fused_single_qkv_rope": False,
    "cross_entropy_loss_fusion": False,
    "transformer_impl": "local",
    "moe_grouped_gemm": False,
    "moe_permute_fusion": False,
    "moe_router_fusion": False,
}
"""Model settings a CPU run needs: fused CUDA kernels off, megatron-core's local layers (and
sequential experts: the grouped GEMM needs CUDA), weights initialized on the CPU."""


def adapt_config(cfg, problems) -> list[str]:
    """Make `cfg` trainable on CPU: apply `CPU_MODEL_SETTINGS` where the user did not choose
    otherwise, and report choices that cannot work on CPU. Returns what changed."""
    model = cfg.model
    changed = set_unless_user_set(
        model,
        CPU_MODEL_SETTINGS,
        problems,
        "model",
        lambda name, current, value: (
            f"{current!r} needs CUDA, but this run trains on CPU",
            f"set model.{name}={value!r} or train on GPUs (dist.distributed_backend='nccl')",
        ),
    )
    if model.num_moe_experts and model.moe_token_dispatcher_type == "flex":
        problems.add(
            "model.moe_token_dispatcher_type",
            "'flex' dispatches through DeepEP or HybridEP kernels, which need CUDA, but this run trains on CPU",
            "use 'alltoall' or 'allgather' on CPU",
        )
    if model.enable_autocast:
        problems.add(
            "model.enable_autocast",
            "megatron-core autocasts the forward pass with torch.autocast('cuda'), which leaves CPU computation in "
            "its own dtype, and this run trains on CPU",
            "leave model.enable_autocast unset on CPU (mixed_precision='bf16_mixed' trains in bf16 there)",
        )
    if cfg.optimizer.optimizer_cpu_offload:
        problems.add(
            "optimizer.optimizer_cpu_offload",
            "megatron-core's hybrid optimizer moves optimizer state from the GPUs to host memory, and this run "
            "trains on CPU (where it fails at the first step)",
            "set optimizer.optimizer_cpu_offload=False on CPU (the optimizer state is in host memory already)",
        )
    if model.sequence_parallel:
        problems.add(
            "model.sequence_parallel",
            "sequence parallelism does not run with megatron-core's local layers on CPU",
            "set model.sequence_parallel=False",
        )
    if cfg.rerun_state_machine.rerun_mode == "report_determinism_stats":
        problems.add(
            "rerun_state_machine.rerun_mode",
            "'report_determinism_stats' fails on CPU in megatron-core 0.16",
            "use 'disabled' or 'validate_results' on CPU",
        )
    ckpt = cfg.checkpoint
    if ckpt.async_save and ckpt.use_persistent_ckpt_worker:
        # megatron-core's persistent async-save worker divides by torch.cuda.device_count()
        changed += set_unless_user_set(
            ckpt,
            {"use_persistent_ckpt_worker": False},
            problems,
            "checkpoint",
            lambda *_: (
                "the persistent async checkpoint worker needs CUDA, but this run trains on CPU",
                "set checkpoint.use_persistent_ckpt_worker=False (a worker per save works on CPU)",
            ),
            show=lambda value: f"{value!r} (the persistent worker needs CUDA)",
        )
    if cfg.straggler is not None and cfg.straggler.log_straggler:
        problems.add(
            "straggler.log_straggler",
            "megatron-core's straggler detector times GPU work with CUDA events, and this run trains on CPU",
            "set straggler.log_straggler=False (or straggler=None) on CPU",
        )
    if cfg.nvrx_straggler is not None and cfg.nvrx_straggler.enabled:
        problems.add(
            "nvrx_straggler.enabled",
            "NVRx straggler detection profiles kernels with CUDA/CUPTI, and this run trains on CPU",
            "set nvrx_straggler.enabled=False (or nvrx_straggler=None) on CPU",
        )
    for name, what in (
        ("use_sharp", "SHARP in-network reductions"),
        ("high_priority_stream_groups", "high-priority communicator streams"),
        ("nccl_communicator_config_path", "per-group NCCL communicator settings"),
    ):
        if getattr(cfg.dist, name):  # megatron-core fails on them deep inside its gloo setup
            problems.add(
                f"dist.{name}",
                f"{what} are NCCL settings, and this run trains on CPU with gloo",
                f"leave dist.{name} unset on CPU",
            )
    if cfg.ddp.nccl_ub:  # megatron-core compiles NCCL's user-buffer allocator with CUDA
        problems.add(
            "ddp.nccl_ub",
            "NCCL user buffers are an NCCL setting, and this run trains on CPU with gloo",
            "leave ddp.nccl_ub unset on CPU",
        )
    if getattr(cfg.dataset, "pin_memory", False):
        # Pinning needs CUDA; a user's explicit True is kept (torch then skips pinning, with a warning).
        changed += set_unless_user_set(cfg.dataset, {"pin_memory": False}, problems, "dataset", lambda *_: None)
    if cfg.logger.log_energy:
        problems.add(
            "logger.log_energy",
            "energy is read from GPU counters (NVML), but this run trains on CPU",
            "set logger.log_energy=False on CPU",
        )
    prof = cfg.profiling
    for name, what in (
        ("use_nsys_profiler", "Nsight Systems profiling"),
        ("record_memory_history", "CUDA memory history"),
        ("nvtx_ranges", "NVTX ranges"),
    ):
        if getattr(prof, name):
            problems.add(
                f"profiling.{name}",
                f"{what} needs a CUDA GPU, but this run trains on CPU",
                f"set profiling.{name}=False; profiling.use_pytorch_profiler=True records CPU traces",
            )
    if changed:
        logger.info("training on CPU: %s", ", ".join(changed))
    return changed
