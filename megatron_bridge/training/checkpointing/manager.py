"""Saving and loading checkpoints with megatron-core `dist_checkpointing` (torch_dist format).

`CheckpointManager` is the protocol the train loop talks to; `DefaultCheckpointManager`
implements it. A user class named by `checkpoint.custom_manager_class` replaces the default.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

import torch

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError
from megatron_bridge.models.hf.files import is_hf_directory
from megatron_bridge.runtime.checkpointing import layout
from megatron_bridge.runtime.checkpointing.safe_reading import load_common
from megatron_bridge.training.checkpointing import state_dict
from megatron_bridge.training.checkpointing.compat import check_architecture
from megatron_bridge.runtime.checkpointing.results_queue import use_results_queue
from megatron_bridge.runtime.child_processes import tie_spawned_target
from megatron_bridge.config.targets import resolve
from megatron_bridge.models.hf.convert import save_run
from megatron_bridge.models.hf.load import load_hf_weights
from megatron_bridge.peft.apply import base_weights_loaded
from megatron_bridge.training import preflight
from megatron_bridge.warning_filters import checkpoint_loading

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer
    from megatron_bridge.training.train import Run

logger = logging.getLogger("megatron_bridge")


@runtime_checkable
class CheckpointManager(Protocol):
    """What the train loop needs from a checkpoint implementation (all methods run on every rank)."""

    def save(self, run: "Run", reason: str) -> None:
        """Save the current state of `run` (iteration `run.state.train_state.step`)."""

    def load(self, run: "Run") -> Optional[int]:
        """Restore `run` from the configured checkpoint; return the iteration loaded, or None when
        there is nothing to load."""

    def finalize_async_saves(self, blocking: bool = False) -> None:
        """Complete background saves that have finished (all of them if `blocking`)."""


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


class DefaultCheckpointManager:
    """torch_dist checkpoints: written under a temporary name, committed by rename, then the
    tracker moves; old checkpoints beyond `most_recent_k` are deleted only after that."""

    def __init__(self, config: "ConfigContainer"):
        self.config = config
        self.ckpt = config.checkpoint
        self._async_queue = None
        self._cached_save_strategy = None
        self._last_saved: Optional[int] = None  # scheduled or written by this job
        self._pending: Optional[int] = None  # the iteration of the latest background save
        self._peft_base: Optional[tuple[str, int]] = None  # base weights a PEFT run loaded

    # ------------------------------------------------------------------ saving
    def save(self, run: "Run", reason: str, rerun_requested: bool = False) -> None:
        from megatron.core import dist_checkpointing

        root, iteration = self.ckpt.save, run.state.train_state.step
        rank = torch.distributed.get_rank()
        if iteration == self._last_saved or layout.read_tracker(root) == iteration:
            return  # saved (or being saved in the background) already, e.g. an exit right after an interval save
        self._last_saved = iteration
        final = layout.iteration_dir(root, iteration)
        staging = final + layout.INCOMPLETE_SUFFIX
        if rank == 0:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        _barrier()
        timers = run.state.timers
        timers("save-checkpoint", log_level=0).start(barrier=False)
        sd = state_dict.build(
            run,
            for_loading=False,
            with_optimizer=self.ckpt.save_optim,
            with_rng=self.ckpt.save_rng,
            with_common=True,
            with_rerun=state_dict.rerun_machine_active(),
            rerun_requested=rerun_requested,
            model_part="adapters" if self.config.peft is not None else "all",
            peft_base=self._peft_base,
        )
        use_results_queue(persistent_worker=self.ckpt.async_save and self.ckpt.use_persistent_ckpt_worker)
        with _space_errors(self.config, iteration):
            if self.ckpt.async_save:
                request = dist_checkpointing.save(sd, staging, self._save_strategy(), async_sharded_save=True)
                request.add_finalize_fn(lambda: self._commit(run, staging, final, iteration, reason))
                self._queue().schedule_async_request(request)
                self._pending = iteration
            else:
                dist_checkpointing.save(sd, staging, self._save_strategy())
                self._commit(run, staging, final, iteration, reason)
        timers("save-checkpoint").stop()

    def _commit(self, run: "Run", staging: str, final: str, iteration: int, reason: str) -> None:
        """Make a fully written checkpoint the latest: rename, then the tracker, then retention."""
        _barrier()  # every rank has finished writing its shards
        root = self.ckpt.save
        if torch.distributed.get_rank() == 0:
            run.state.cfg.to_yaml(os.path.join(staging, layout.RUN_CONFIG_FILE))
            if os.path.isdir(final):
                # A complete checkpoint of this iteration from an earlier job (which died before
                # moving the tracker): kept, under another name, never deleted.
                kept = f"{final}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
                os.rename(final, kept)
                logger.warning("an earlier checkpoint of iteration %d was moved to %s", iteration, kept)
            os.rename(staging, final)
            layout.write_tracker(root, iteration)
            self._apply_retention(root, iteration)
        _barrier()
        if run.state.is_logging_rank:
            logger.info("saved checkpoint of iteration %d to %s (%s)", iteration, final, reason)
        if run.state.progress is not None:
            run.state.progress.checkpoint_saved(iteration)

    def _apply_retention(self, root: str, newest: int) -> None:
        keep = self.ckpt.most_recent_k
        if keep is None or keep < 1:
            return
        complete = [it for it in layout.complete_iterations(root) if it <= newest]
        for old in complete[:-keep]:
            shutil.rmtree(layout.iteration_dir(root, old), ignore_errors=True)

    def _save_strategy(self):
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        if self._cached_save_strategy is None:
            strategy = TorchDistSaveShardedStrategy(
                "torch_dist", 1, thread_count=self.ckpt.storage_writers_per_rank,
                cached_metadata=self.ckpt.ckpt_assume_constant_structure,
            )  # fmt: skip
            if self.ckpt.fully_parallel_save and parallel_state.get_data_parallel_world_size() > 1:
                strategy = FullyParallelSaveStrategyWrapper(
                    strategy, parallel_state.get_data_parallel_group(with_context_parallel=True),
                    self.ckpt.ckpt_assume_constant_structure,
                )  # fmt: skip
            self._cached_save_strategy = strategy
        return self._cached_save_strategy

    def _queue(self):
        if self._async_queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, PersistentAsyncCaller

            if self.ckpt.use_persistent_ckpt_worker:
                tie_spawned_target(PersistentAsyncCaller, "async_loop")  # it must not outlive a killed trainer
            self._async_queue = AsyncCallsQueue(persistent=self.ckpt.use_persistent_ckpt_worker)
        return self._async_queue

    def finalize_async_saves(self, blocking: bool = False) -> None:
        if self._async_queue is not None:
            with _space_errors(self.config, self._pending):
                self._async_queue.maybe_finalize_async_calls(blocking=blocking)
            if blocking:
                self._async_queue.close()
                self._async_queue = None

    # ------------------------------------------------------------------ loading
    def source(self) -> Optional[tuple[str, bool]]:
        """(path, resume) to load from: `load` resumes the full state (unless `finetune`),
        `pretrained_checkpoint` gives weights only. None: start fresh."""
        c = self.ckpt
        if c.load and layout.has_checkpoint(c.load):
            return c.load, not c.finetune
        if c.pretrained_checkpoint:
            return c.pretrained_checkpoint, False
        if c.load and c.exit_on_missing_checkpoint:
            raise FileNotFoundError(f"checkpoint.load={c.load!r} holds no checkpoint and exit_on_missing_checkpoint is set")
        return None

    def load(self, run: "Run") -> Optional[int]:
        if self.config.peft is not None:
            return self._load_peft(run)
        found = self.source()
        if found is None:
            if not self.config.model.perform_initialization:
                raise ConfigValidationError(
                    [
                        ConfigProblem(
                            "model.perform_initialization",
                            f"False leaves the weights uninitialized, and checkpoint.load={self.ckpt.load!r} holds no "
                            "checkpoint to load into them",
                            "point checkpoint.load at a saved run, or leave model.perform_initialization=True",
                        )
                    ]
                )
            return None
        path, resume = found
        if not resume and is_hf_directory(path):
            return self._load_hf(run, path)
        directory, iteration = layout.resolve(path, self.ckpt.ckpt_step)
        self._restore(run, directory, iteration, resume, "all")
        return iteration

    def _load_peft(self, run: "Run") -> int:
        """A PEFT run: the base weights from `pretrained_checkpoint` (a checkpoint of ours or a
        Hugging Face directory), then, when `load` holds a checkpoint of this run, its adapters
        and training state (`ckpt_step` picks the iteration of the checkpoint resumed from, else
        of the base)."""
        from megatron.core import dist_checkpointing

        c = self.ckpt
        resume = layout.has_checkpoint(c.load)
        if is_hf_directory(c.pretrained_checkpoint):
            base_dir, base_iteration = c.pretrained_checkpoint, 0
            self._load_hf(run, base_dir, "base weights")
        else:
            base_dir, base_iteration = layout.resolve(c.pretrained_checkpoint, None if resume else c.ckpt_step)
            if load_common(base_dir).get("peft"):
                raise ConfigValidationError(ConfigProblem(
                    "checkpoint.pretrained_checkpoint", f"{c.pretrained_checkpoint!r} holds the adapters of a PEFT run, not base weights",
                    "point it at the base model's checkpoint, or fold the adapters in first (mbridge peft merge)",
                ))  # fmt: skip
            self._restore(run, base_dir, base_iteration, False, "base")
        self._peft_base = (base_dir, base_iteration)
        if not resume:
            base_weights_loaded(run.state.model)
            run.state.optimizer.reload_model_params()
            return base_iteration
        directory, iteration = layout.resolve(c.load, c.ckpt_step)
        recorded = load_common(directory).get("peft")
        if not recorded:
            raise ConfigValidationError(ConfigProblem(
                "checkpoint.load", f"{c.load!r} holds a checkpoint without adapters; a PEFT run resumes only from its own adapter checkpoints",
                "set checkpoint.load to this run's save directory (or a new one); the base goes in pretrained_checkpoint",
            ))  # fmt: skip
        was = recorded.get("pretrained_iteration_dir")
        if was and os.path.abspath(was) != os.path.abspath(base_dir) and run.state.is_logging_rank:
            logger.warning("the adapters in %s were trained on the base in %s; loading them onto %s", directory, was, base_dir)
        self._restore(run, directory, iteration, not c.finetune, "adapters")
        return iteration

    def _restore(self, run: "Run", directory: str, iteration: int, resume: bool, part: str) -> None:
        """Load the `part` weights of the checkpoint in `directory` into `run`; with `resume`, also
        its optimizer, scheduler, counters and RNG states."""
        from megatron.core import dist_checkpointing

        check_architecture(directory, self.config.model)  # the config's checks read its pickled files too
        common = load_common(directory)
        same_layout = common.get("layout") == state_dict.layout()
        with_optimizer = resume and self.ckpt.load_optim and common.get("saved_optimizer", True)
        with_rng = resume and self.ckpt.load_rng and same_layout and common.get("saved_rng", False)
        with_rerun = resume and common.get("saved_rerun", False) and state_dict.rerun_machine_active()
        template = state_dict.build(
            run, for_loading=True, with_optimizer=with_optimizer, with_rng=with_rng, with_common=False,
            with_rerun=with_rerun, model_part=part,
        )  # fmt: skip
        strategy = self._load_strategy(directory)
        with checkpoint_loading():
            loaded = dist_checkpointing.load(template, directory, strategy, strict=self.ckpt.dist_ckpt_strictness)
        for key, chunk in zip(state_dict.model_keys(run), run.state.model):
            state_dict.load_model_state(chunk, loaded[key], part)
        if with_optimizer:
            run.state.optimizer.load_state_dict(loaded["optimizer"])
        else:
            # Optimizers that keep their own copy of the weights (fp16/bf16 main params) take
            # the loaded ones; otherwise the first step would bring back the initial weights.
            run.state.optimizer.reload_model_params()
        if resume:
            _load_scheduler(run.state.scheduler, common["opt_param_scheduler"])
            run.state.train_state.load_state_dict(common["train_state"])
            if with_rng:
                state_dict.restore_rng_state(loaded["rng_state"])
            elif self.ckpt.load_rng and not same_layout and run.state.is_logging_rank:
                logger.info("RNG states not restored: the parallel layout differs from the checkpoint's")
            if with_rerun:
                from megatron.core.rerun_state_machine import get_rerun_state_machine

                get_rerun_state_machine().load_state_dict(loaded["rerun_state_machine"])
            if run.state.fault_tolerance is not None:
                run.state.fault_tolerance.load_state_dict(common.get("ft_state"))
        _barrier()
        if run.state.is_logging_rank:
            what = {"all": "", "base": "base weights of ", "adapters": "adapters of "}[part]
            kind = f"resumed from {what}" if resume else f"loaded {what or 'weights of '}"
            logger.info("%siteration %d in %s%s", kind, iteration, directory, _spread_note(strategy))

    def _load_hf(self, run: "Run", path: str, what: str = "weights") -> int:
        """Weights only, from a Hugging Face directory (checked before the model was built); in
        an adapted model, its base weights."""
        load_hf_weights(run.state.model, path)
        run.state.optimizer.reload_model_params()
        _barrier()
        if run.state.is_logging_rank:
            logger.info("loaded %s of the Hugging Face model in %s", what, path)
        return 0

    def _load_strategy(self, directory: str):
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

        strategy = get_default_load_sharded_strategy(directory)
        if self.ckpt.fully_parallel_load and parallel_state.get_data_parallel_world_size() > 1:
            strategy = FullyParallelLoadStrategyWrapper(strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
        return strategy


def _spread_note(load_strategy: Any) -> str:
    """How the reading of a checkpoint was shared out (`checkpoint.fully_parallel_load`)."""
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    if not isinstance(load_strategy, FullyParallelLoadStrategyWrapper):
        return ""
    return f" (reading spread over {torch.distributed.get_world_size(load_strategy.parallelization_group)} ranks)"


@contextlib.contextmanager
def _space_errors(config: "ConfigContainer", iteration: Optional[int]):
    """Re-raise a write that failed for lack of space as one that says so, with the numbers. The
    partly written checkpoint is removed: left there, it would hold on to the space that the
    user frees to resume."""
    try:
        yield
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)) and preflight.is_out_of_space(exc):
            # the error states the free space when the save failed, before the partial save is removed
            error = preflight.out_of_space_error(config, iteration if iteration is not None else -1, exc)
            if iteration is not None:
                staging = layout.iteration_dir(config.checkpoint.save, iteration) + layout.INCOMPLETE_SUFFIX
                shutil.rmtree(staging, ignore_errors=True)
            raise error from exc
        raise


def _load_scheduler(scheduler: Any, saved: dict) -> None:
    try:
        scheduler.load_state_dict(saved)
    except AssertionError as exc:  # megatron-core asserts that the schedules agree
        raise ValueError(
            f"the learning-rate schedule differs from the checkpoint's ({exc}); set "
            "scheduler.override_opt_param_scheduler=True to use this config's schedule, or "
            "scheduler.use_checkpoint_opt_param_scheduler=True to continue the checkpoint's"
        ) from None


def make_manager(config: "ConfigContainer") -> CheckpointManager:
    """The default manager, or an instance of `checkpoint.custom_manager_class(config)`."""
    name = config.checkpoint.custom_manager_class
    if not name:
        return DefaultCheckpointManager(config)

    try:
        cls = resolve(name)  # a name from a config file: registered classes only
    except ImportError as exc:
        raise ImportError(f"checkpoint.custom_manager_class: {exc}") from exc
    manager = cls(config)
    missing = [m for m in ("save", "load", "finalize_async_saves") if not callable(getattr(manager, m, None))]
    if missing:
        raise TypeError(f"checkpoint.custom_manager_class: {name} lacks {missing} of the CheckpointManager protocol")
    return manager


class Checkpointer:
    """The train loop's view of checkpointing: when to save, and saving at the end."""

    def __init__(self, config: "ConfigContainer", manager: CheckpointManager):
        self.config = config
        self.manager = manager

    def due(self, step: int) -> bool:
        interval = self.config.checkpoint.save_interval
        return bool(interval) and step % interval == 0

    def save(self, run: "Run", reason: str, rerun_requested: bool = False) -> None:
        ft = run.state.fault_tolerance
        with ft.section("checkpointing") if ft is not None else contextlib.nullcontext():
            if rerun_requested:  # only the built-in manager takes it; custom ones keep save(run, reason)
                self.manager.save(run, reason, rerun_requested=True)
            else:
                self.manager.save(run, reason)

    def poll(self) -> None:
        if self.config.checkpoint.async_save:
            self.manager.finalize_async_saves(blocking=False)

    def finalize(self, run: "Run", save: bool = True) -> None:
        """Save the final state (if not saved yet, and `save`) and wait for background saves; with
        `checkpoint.save_hf`, write the trained model as a Hugging Face directory too."""
        if save and run.state.train_state.do_train:
            self.manager.save(run, "end of training")
        self.manager.finalize_async_saves(blocking=True)
        if self.config.checkpoint.save_hf and run.state.train_state.step >= self.config.train.train_iters:
            out_dir = save_run(run)
            if run.state.is_logging_rank:
                logger.info("saved the model in Hugging Face format to %s", out_dir)
