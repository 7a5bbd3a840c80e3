"""Turn a `ConfigContainer` into a ready-to-train `Run`, in a fixed order."""

from __future__ import annotations

import logging
import random
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.config import status as field_status
from megatron_bridge.models.hf import checks as hf_checks
from megatron_bridge.runtime import cpu_backend
from megatron_bridge.runtime.callbacks import Callback, CallbackList
from megatron_bridge.runtime.child_processes import die_with_parent
from megatron_bridge.runtime.launcher_env import launcher_int
from megatron_bridge.training.comm_overlap import initialize_tp_communicators
from megatron_bridge.training.config import ConfigContainer, runtime_config_update
from megatron_bridge.runtime.distributed import cpu_threads, init_model_parallel, init_process_group, run_backend
from megatron_bridge.training.forward_step_adapter import prepare_forward_step
from megatron_bridge.training.launcher_watch import stop_when_launcher_dies
from megatron_bridge.training.progress import ProgressFile
from megatron_bridge.training.signals import ExitSignalHandler
from megatron_bridge.training.state import GlobalState
from megatron_bridge.training.train import Run
from megatron_bridge.data.builders import build_datasets, resolved_phases, resumed_sample_counts
from megatron_bridge.data.checks import build_checked_tokenizer, check_before_build
from megatron_bridge.training.memory_fit import refuse_what_host_memory_cannot_hold, refuse_what_the_gpu_cannot_hold
from megatron_bridge.data.loaders import build_iterator
from megatron_bridge.data.phases import PhaseAnnouncer
from megatron_bridge.models.attention import layer_problems
from megatron_bridge.peft.apply import trainable_counts
from megatron_bridge.training import build, console, preflight
from megatron_bridge.training.checkpointing import Checkpointer, lock, make_manager
from megatron_bridge.training.loggers import build_tracker
from megatron_bridge.training.resiliency.fault_tolerance import FaultTolerance, maybe_simulate_fault
from megatron_bridge.training.resiliency.stragglers import StragglerMonitor

logger = logging.getLogger("megatron_bridge")


def resolve_config(cfg: ConfigContainer) -> str:
    """Adapt `cfg` to the device it will train on, then `runtime_config_update`; returns the device.
    A launch that cannot use the backend on this machine (more processes than GPUs for NCCL) is
    refused here, before anything is built."""
    device = "cuda" if run_backend(cfg.dist) == "nccl" else "cpu"
    runtime_config_update(cfg, device=device)
    return device


def refuse_what_the_layers_cannot_run(cfg: ConfigContainer) -> None:
    """Raise `ConfigValidationError` for settings the layers built here cannot run (context
    parallelism on local layers), before any process group or model exists."""
    found = layer_problems(cfg.model)
    if found:
        raise ConfigValidationError(found)


# megatron-core logs these at WARNING level although nothing is wrong.
_ROUTINE_MESSAGES = {
    "megatron.core.rerun_state_machine": ("RerunStateMachine initialized in mode", "Setting RerunStateMachine mode"),
    "megatron.core.datasets.gpt_dataset": ("Unable to save",),
}


class _DropRoutine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        prefixes = _ROUTINE_MESSAGES.get(record.name, ())
        return not str(record.msg).startswith(prefixes)


_LEVEL_BEFORE_FILTERING: dict[str, int] = {}


def _filter_megatron_warnings(on: bool) -> None:
    """Drop megatron-core's messages below WARNING and its routine warnings
    (`logger.filter_warnings`), or undo that for a later job of this process that turns it off."""
    core = logging.getLogger("megatron.core")
    if on:
        _LEVEL_BEFORE_FILTERING.setdefault(core.name, core.level)
        core.setLevel(logging.WARNING)
    elif core.name in _LEVEL_BEFORE_FILTERING:
        core.setLevel(_LEVEL_BEFORE_FILTERING.pop(core.name))
    for name in _ROUTINE_MESSAGES:
        source = logging.getLogger(name)
        installed = [f for f in source.filters if isinstance(f, _DropRoutine)]
        if on and not installed:
            source.addFilter(_DropRoutine())
        elif not on:
            for f in installed:
                source.removeFilter(f)


def configure_logging(state: GlobalState) -> None:
    """Progress lines from the logging rank on stdout (unless the application configured
    logging itself); warnings from every rank."""
    cfg = state.cfg.logger
    console.log_to_console(cfg.logging_level, state.is_logging_rank)
    _filter_megatron_warnings(cfg.filter_warnings)
    for name in cfg.modules_to_filter or []:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    if cfg.set_level_for_all_loggers and cfg.logging_level is not None:
        logging.getLogger().setLevel(cfg.logging_level)


def set_seeds(cfg: ConfigContainer) -> None:
    """Python/NumPy/torch seeds, offset per pipeline stage; megatron-core's per-group RNG streams."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    pp_rank, dp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    seed = rank_seed(cfg.rng, pp_rank, dp_rank)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, te_rng_tracker=cfg.rng.te_rng_tracker, inference_rng_tracker=cfg.rng.inference_rng_tracker)


def rank_seed(rng, pipeline_rank: int, data_parallel_rank: int) -> int:
    """The seed of one rank (Megatron-LM's offsets): each pipeline stage initializes its own
    layers; data-parallel replicas share weights unless `rng.data_parallel_random_init`."""
    seed = rng.seed + 100 * pipeline_rank
    if rng.data_parallel_random_init:
        seed += 10 * data_parallel_rank
    return seed


def use_deterministic_algorithms() -> tuple[bool, bool]:
    """What model.deterministic_mode asks of torch (as Megatron-LM does): deterministic kernels
    only, failing on an op that has none; cuBLAS needs a fixed workspace for that. Returns torch's
    setting before (on, warn only), which the run puts back when it ends."""
    import os

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    logger.info("deterministic mode: torch.use_deterministic_algorithms(True)")
    return before


def _rng_snapshot() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    snapshot = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        snapshot["cuda"] = torch.cuda.get_rng_state()
    snapshot["tracker"] = get_cuda_rng_tracker().get_states()
    return snapshot


def _rng_restore(snapshot: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(snapshot["python"])
    np.random.set_state(snapshot["numpy"])
    torch.set_rng_state(snapshot["torch"])
    if "cuda" in snapshot:
        torch.cuda.set_rng_state(snapshot["cuda"])
    get_cuda_rng_tracker().set_states(snapshot["tracker"])


def init_rerun_state_machine(cfg: ConfigContainer) -> None:
    """megatron-core's rerun state machine in the configured mode; a re-run restores RNG states so
    it repeats the step exactly."""
    from megatron.core.rerun_state_machine import (
        RerunDiagnostic,
        RerunErrorInjector,
        RerunMode,
        initialize_rerun_state_machine,
    )

    r = cfg.rerun_state_machine
    initialize_rerun_state_machine(
        state_save_func=_rng_snapshot,
        state_restore_func=_rng_restore,
        mode=RerunMode(r.rerun_mode),
        error_injector=RerunErrorInjector(
            error_injection_rate=r.error_injection_rate, error_injection_type=RerunDiagnostic(r.error_injection_type)
        ),
    )


def build_data_iterators(cfg: ConfigContainer, state: GlobalState, num_chunks: int):
    """Train/valid/test micro-batch iterators for this data-parallel rank (one per model chunk
    for virtual pipelining), resuming at the consumed-sample counters."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.rerun_state_machine import RerunDataIterator

    ts, t, v = state.train_state, cfg.train, cfg.validation
    counts = resumed_sample_counts(cfg, ts.step, ts.consumed_train_samples, ts.consumed_valid_samples)
    train_ds, valid_ds, test_ds = build_datasets(cfg, state.tokenizer, ProcessGroupCollection.use_mpu_process_groups(), counts)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    pin = state.device == "cuda"

    def iterators(dataset, consumed, mbs, gbs, needed, split):
        made = [build_iterator(cfg, dataset, consumed, mbs, gbs, needed, dp_rank, dp_size, pin, split=split) for _ in range(num_chunks)]
        if made[0] is None:
            return None
        wrapped = [RerunDataIterator(it) for it in made]
        return wrapped if num_chunks > 1 else wrapped[0]

    train_it = iterators(train_ds, ts.consumed_train_samples, t.micro_batch_size, t.global_batch_size, counts.train, "train")
    _check_splits_asked_for(cfg, state, train_ds, valid_ds)
    valid_it = test_it = None
    if v.eval_iters:
        valid_it = iterators(valid_ds, ts.consumed_valid_samples, v.eval_micro_batch_size, v.eval_global_batch_size, counts.valid, "valid")
    if counts.test:
        test_it = iterators(test_ds, 0, v.eval_micro_batch_size, v.eval_global_batch_size, counts.test, "test")
    ts.do_train = train_it is not None and t.train_iters > 0 and not v.skip_train
    ts.do_valid = valid_it is not None
    ts.do_test = test_it is not None
    return train_it, valid_it, test_it


def _check_splits_asked_for(cfg: ConfigContainer, state: GlobalState, train_ds: Any, valid_ds: Any) -> None:
    """A dataset may leave out splits (None), but not the training set of a run that trains: the
    run would end at once as if complete. A missing validation set only skips evaluation: said
    once, with the setting that says so."""
    ts, t, v = state.train_state, cfg.train, cfg.validation
    kind = type(cfg.dataset).__name__
    if train_ds is None and not v.skip_train and ts.step < t.train_iters:
        raise ConfigValidationError(ConfigProblem(
            "dataset", f"{kind} gives no training set (None), but train.train_iters={t.train_iters} asks for training",
            "return a training dataset from build_datasets, or set validation.skip_train=true to only evaluate",
        ))  # fmt: skip
    if valid_ds is None and v.eval_iters and state.is_logging_rank:
        logger.warning(
            "no validation set: %s gives none, so validation.eval_iters=%d evaluates nothing "
            "(set validation.eval_iters=0 to run without evaluation)", kind, v.eval_iters,
        )


def check_outputs_and_lock(cfg: ConfigContainer, state: GlobalState) -> None:
    """Before anything is built: every output directory of each rank must be writable, and the
    save directory must not be in use by another job (rank 0 locks it). Every rank raises the
    same `ConfigValidationError` when any rank found a problem."""
    found = preflight.check_outputs(cfg, create=True, logging_rank=state.is_logging_rank)
    if cfg.checkpoint.save and state.rank == 0 and not found:
        try:
            state.save_lock = lock.acquire(cfg.checkpoint.save)
        except lock.SaveDirectoryInUse as exc:
            found.append(ConfigProblem("checkpoint.save", str(exc), "each job needs its own save directory"))
    if state.world_size > 1:
        everyone: list = [None] * state.world_size
        torch.distributed.all_gather_object(everyone, found)
        found = list(dict.fromkeys(p for rank_problems in everyone for p in rank_problems))
    preflight.raise_problems(found)
    warning = preflight.free_space_warning(cfg) if state.is_logging_rank else None
    if warning:
        logger.warning("%s", warning)


def _start_resiliency(cfg: ConfigContainer, state: GlobalState) -> list[Callback]:
    """Fault-tolerance reports (from now on: setup is their first section) and simulated faults."""
    if cfg.ft is None:
        return []

    maybe_simulate_fault(cfg.ft, state.rank, state.world_size)
    if not cfg.ft.enable_ft_package:
        return []
    state.fault_tolerance = FaultTolerance(cfg.ft, state.rank)
    return [state.fault_tolerance]


def _data_phase_callbacks(cfg: ConfigContainer, state: GlobalState) -> list[Callback]:
    """The console announcer of blend phases (`dataset.blend_phases`), if any."""
    phases = resolved_phases(cfg)
    if phases is None:
        return []

    state.data_phases = PhaseAnnouncer(phases, list(cfg.dataset.blend[0]))
    return [state.data_phases]


def setup(
    cfg: ConfigContainer,
    forward_step_func: Callable,
    callbacks: Optional[Iterable[Callback]] = None,
    state: Optional[GlobalState] = None,
    store: Optional[torch.distributed.Store] = None,
) -> Run:
    """Resolve the config, join/create process groups (through `store` when given), and build
    everything a run needs."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.timers import Timers

    # What validation decides for the user (a preset's settings, a warmup scaled to the run) is
    # logged, so the console is set up first, on the rank the launcher says will log.
    console.log_to_console(cfg.logger.logging_level, launcher_int("RANK", 0) == launcher_int("WORLD_SIZE", 1) - 1)
    device = resolve_config(cfg)
    die_with_parent()
    stop_when_launcher_dies()
    hf_checks.preflight(cfg)  # Hugging Face weight files, before anything is built
    field_status.refuse_on_this_machine(cfg, device)  # settings that need a GPU or TransformerEngine
    refuse_what_the_layers_cannot_run(cfg)
    refuse_what_host_memory_cannot_hold(cfg, on_cpu=device == "cpu")  # before the first large allocation fails or swaps
    state = state if state is not None else GlobalState(cfg=cfg)
    state.device, state.created_process_group = init_process_group(cfg, store)
    if state.device == "cuda":
        refuse_what_the_gpu_cannot_hold(cfg)  # before batches larger than the GPU are built
    state.rank, state.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    state.logging_rank = state.world_size - 1
    configure_logging(state)
    check_outputs_and_lock(cfg, state)
    internal_callbacks = _start_resiliency(cfg, state)
    if state.device == "cpu":
        state.cpu_backend_activated = cpu_backend.activate(device="cpu")
        torch.set_num_threads(cpu_threads(state.world_size))
    init_model_parallel(cfg)
    state.tp_communicators = initialize_tp_communicators(cfg.model, cfg.train.micro_batch_size)
    t = cfg.train
    init_num_microbatches_calculator(
        state.rank, t.rampup_batch_size, t.global_batch_size, t.micro_batch_size, cfg.data_parallel_size, t.decrease_batch_size_if_needed
    )
    set_seeds(cfg)
    if cfg.model.deterministic_mode:
        state.deterministic_before = use_deterministic_algorithms()
    init_rerun_state_machine(cfg)
    state.timers = Timers(max(cfg.logger.timing_log_level, 0), cfg.logger.timing_log_option)
    state.tokenizer = build_checked_tokenizer(cfg)
    check_before_build(cfg, state.tokenizer)  # data files, vocabulary: before anything is allocated
    # Trackers in a helper process start while the model and data are built; logging the config
    # at the end of setup waits for them and raises if one could not start.
    state.tracker = build_tracker(cfg, state.is_logging_rank)

    model = build.build_model(cfg, state)
    optimizer, scheduler = build.build_optimizer(cfg, model, state)
    build.wire_model_config(cfg, model, optimizer)
    state.model, state.optimizer, state.scheduler = model, optimizer, scheduler
    if state.is_logging_rank:
        logger.info(
            "model: %d parameters on this rank (TP=%d PP=%d CP=%d DP=%d), %s on %s",
            build.count_local_parameters(model),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_data_parallel_world_size(),
            type(optimizer).__name__,
            state.device,
        )
        if cfg.peft is not None:
            trainable, total = trainable_counts(model)
            logger.info(
                "%s: %d trainable parameters of %d on this rank (%.3f%%); the base weights are frozen",
                cfg.peft.method_name, trainable, total, 100.0 * trainable / max(total, 1),
            )  # fmt: skip
    if (cfg.straggler is not None and cfg.straggler.log_straggler) or (cfg.nvrx_straggler is not None and cfg.nvrx_straggler.enabled):
        state.stragglers = StragglerMonitor(state)
        internal_callbacks.append(state.stragglers)
    internal_callbacks += _data_phase_callbacks(cfg, state)
    callback_list = CallbackList([*internal_callbacks, *(callbacks or [])])
    run = Run(state=state, forward_step=prepare_forward_step(forward_step_func, state), callbacks=callback_list)
    manager = make_manager(cfg)
    manager.load(run)  # before the data iterators: they resume at the loaded sample counts
    state.progress = ProgressFile.for_run(state)
    if state.progress is not None:
        state.progress.started()
    if cfg.checkpoint.save:
        run.checkpointer = Checkpointer(cfg, manager)
    if t.exit_signal_handler:
        state.signal_handler = ExitSignalHandler(t.exit_signal).install()
    run.train_iterator, run.valid_iterator, run.test_iterator = build_data_iterators(cfg, state, len(model))
    if state.is_logging_rank:
        state.tracker.log_config(cfg.to_dict())
    if cfg.logger.save_config_filepath and state.rank == 0:
        cfg.to_yaml(cfg.logger.save_config_filepath)  # resolved: derived values and vocab size filled in
    return run
