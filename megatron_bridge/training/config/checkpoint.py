"""Where and how checkpoints are saved and loaded."""

from __future__ import annotations

import os
from typing import Literal, Optional

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import INTERVAL, SIZE, STEPS, Unsupported, field, parse
from megatron_bridge.config.targets import TargetNotAllowedError, resolve

ASYNC_FORMATS = ("torch_dist",)

_NON_PERSISTENT = Unsupported(
    "non-persistent checkpoints are not implemented (megatron-core 0.16.1 has no manager for them); "
    "use checkpoint.save_interval"
)

@config_dataclass(kw_only=True)
class CheckpointConfig(ConfigBase):
    """Configuration settings for model checkpointing (saving and loading)."""

    _field_aliases = {"save_hf_weights": "save_hf"}

    save: Optional[str] = None
    """Directory to save checkpoints to (None: never save)."""

    save_interval: Optional[int] = field(None, range=INTERVAL)
    """Save every N iterations into `save` (a checkpoint is also saved at the end of training and
    on exit); refused when `save` is not given."""

    save_optim: bool = True
    """Save optimizer state."""

    save_rng: bool = True
    """Save RNG states."""

    load: Optional[str] = None
    """Directory to resume from: its latest complete checkpoint, or `ckpt_step` (a directory
    without checkpoints starts the run from scratch; a file, one `iter_*` directory, or a run
    directory whose `checkpoints/` holds them, is refused before the run starts)."""

    load_optim: bool = True
    """Load optimizer state when resuming."""

    load_main_params_from_ckpt: bool = field(
        False,
        status=Unsupported('not implemented: fp32 main parameters are always re-derived from the model weights'),
    )
    """Load fp32 main parameters from the checkpoint instead of re-deriving them from the model."""

    load_rng: bool = True
    """Load RNG states when resuming."""

    non_persistent_save_interval: Optional[int] = field(None, range=INTERVAL, status=_NON_PERSISTENT)
    """Iterations between non-persistent (fast, temporary) saves."""

    non_persistent_ckpt_type: Optional[Literal["global", "local", "in_memory"]] = field(None, status=_NON_PERSISTENT)
    """Kind of non-persistent checkpoint."""

    non_persistent_global_ckpt_dir: Optional[str] = field(None, status=_NON_PERSISTENT)
    """Directory for global non-persistent checkpoints."""

    non_persistent_local_ckpt_dir: Optional[str] = field(None, status=_NON_PERSISTENT)
    """Directory for local non-persistent checkpoints."""

    non_persistent_local_ckpt_algo: Literal["fully_parallel", "atomic"] = field(
        "fully_parallel",
        status=_NON_PERSISTENT,
    )
    """Algorithm for local non-persistent checkpoints."""

    finetune: bool = False
    """Load model weights only: no optimizer or RNG state, and the iteration count restarts at 0."""

    pretrained_checkpoint: Optional[str] = None
    """Directory containing a pretrained model checkpoint for finetuning.

    Either a parent directory with a tracker file and `iter_*` subdirectories, one `iter_*`
    directory holding the checkpoint itself, or a Hugging Face model directory (config.json and
    safetensors weights), read directly: each rank reads only its slices."""

    ckpt_step: Optional[int] = field(None, range=STEPS)
    """Load this iteration instead of the latest."""

    exit_on_missing_checkpoint: bool = False
    """Exit with an error when `load` is set but holds no checkpoint (instead of starting fresh)."""

    ckpt_format: Literal["torch_dist", "zarr", "fsdp_dtensor"] = field(
        "torch_dist",
        status=Unsupported(
            "only torch_dist checkpoints are written: zarr is deprecated in megatron-core, fsdp_dtensor needs Megatron"
            " FSDP; use torch_dist"
        ),
    )
    """On-disk format of checkpoints."""

    fully_parallel_save: bool = True
    """Spread the writing of replicated tensors over data-parallel ranks."""

    fully_parallel_load: bool = False
    """Spread the reading of replicated tensors over data-parallel ranks."""

    async_save: bool = False
    """Write checkpoints in the background while training continues (torch_dist only)."""

    use_persistent_ckpt_worker: bool = True
    """Use one persistent background worker for async saves (False: a temporary one per save)."""

    async_strategy: Literal["nvrx", "mcore"] = field(
        "nvrx",
        status=Unsupported("not implemented: async saves always use megatron-core's writer"),
    )
    """Async checkpoint strategy: "nvrx" (nvidia-resiliency-ext, falls back to "mcore" when it is
    not installed) or "mcore"."""

    async_write_results_mp_mode: Literal["fork", "spawn", "forkserver"] = field(
        "fork",
        status=Unsupported("not implemented: megatron-core's async writer chooses its own start method"),
    )
    """Multiprocessing start method for the async write results queue."""

    ckpt_assume_constant_structure: bool = False
    """Reuse the save plan across saves (the model structure must not change)."""

    dist_ckpt_strictness: Literal[
        "assume_ok_unexpected",
        "log_unexpected",
        "log_all",
        "raise_unexpected",
        "raise_all",
        "return_unexpected",
        "return_all",
        "ignore_all",
    ] = "assume_ok_unexpected"
    """How to treat mismatching keys between the checkpoint and the model when loading."""

    storage_writers_per_rank: int = field(1, range=SIZE)
    """Storage writers per rank (torch_dist); a checkpoint has saving ranks x this many files."""

    strict_fsdp_dtensor_load: bool = field(
        False,
        status=Unsupported('fsdp_dtensor checkpoints are not supported; use ckpt_format=torch_dist'),
    )
    """Whether to enforce strict loading for FSDP DTensor checkpoints."""

    most_recent_k: Optional[int] = field(
        -1, range=parse("[1, 2**31)", also=(-1,), below="must be -1 (keep all) or >= 1")
    )
    """Keep only the k most recent checkpoints (-1: keep all). Old ones are deleted only after a
    new one is complete."""

    save_hf: bool = False
    """At the end of training, also write the model as a Hugging Face directory (sharded
    safetensors with an index, config.json, tokenizer files) next to the final checkpoint:
    `<save>/hf_iter_NNNNNNN`. In a LoRA/DoRA run that is the model with the adapters folded in,
    and `<save>/hf_iter_NNNNNNN_adapter` holds the adapters in the peft format. Alias:
    `save_hf_weights`."""

    save_hf_dtype: Optional[Literal["bf16", "fp16", "fp32"]] = None
    """dtype of the weights `save_hf` writes (None: that of the Hugging Face model the run
    started from, else the dtype the model trains its weights in)."""

    save_tokenizer_assets: bool = field(
        True,
        status=Unsupported('not implemented: checkpoints do not include the tokenizer files'),
    )
    """Copy the tokenizer files into each checkpoint."""

    custom_manager_class: Optional[str] = None
    """Import path of a class implementing the checkpoint manager protocol (save / load /
    finalize_async_saves) that replaces the default, e.g. 'mypackage.ckpt.MyManager'."""

    def _finalize(self, problems: Problems) -> None:
        p = problems
        self._check_saving_settings(p)
        self._check_loading_settings(p)
        if self.async_save:
            p.check(self.save is not None, "async_save", "async_save needs a save directory", "set checkpoint.save")
            p.check(
                self.ckpt_format in ASYNC_FORMATS,
                "async_save",
                f"async_save is not supported with ckpt_format={self.ckpt_format!r}",
                f"use ckpt_format in {list(ASYNC_FORMATS)} or turn async_save off",
            )
        if self.ckpt_step is not None:
            p.check(
                self.load is not None or self.pretrained_checkpoint is not None,
                "ckpt_step",
                f"ckpt_step={self.ckpt_step} is set but there is nothing to load",
                "set checkpoint.load (or pretrained_checkpoint), or remove ckpt_step",
            )
        if self.pretrained_checkpoint is not None:
            p.check(
                os.path.isdir(self.pretrained_checkpoint),
                "pretrained_checkpoint",
                f"directory {self.pretrained_checkpoint!r} does not exist",
                "point it at a checkpoint directory or one of its iter_* subdirectories",
            )
        if self.save_hf:
            p.check(
                self.save is not None,
                "save_hf",
                "the Hugging Face directory is written next to the final checkpoint, and checkpoint.save is not set",
                "set checkpoint.save (or save_hf=False)",
            )
        if self.custom_manager_class is not None:
            try:
                manager = resolve(self.custom_manager_class)
            except TargetNotAllowedError as exc:
                p.add("custom_manager_class", exc.message, exc.fix)
            else:
                p.check(
                    isinstance(manager, type),
                    "custom_manager_class",
                    f"{self.custom_manager_class!r} is not a class",
                    "name a class implementing save / load / finalize_async_saves",
                )

    def _check_loading_settings(self, problems: Problems) -> None:
        """`finetune` and `exit_on_missing_checkpoint` act only on the checkpoint in `load`
        (`pretrained_checkpoint` is always read as weights only): without `load` they would be
        ignored."""
        if self.load:
            return
        for name, why in (
            ("finetune", "it loads the checkpoint in checkpoint.load as weights only, and load is not set"),
            ("exit_on_missing_checkpoint", "it is about a checkpoint missing from checkpoint.load, and load is not set"),
        ):
            problems.check(
                not getattr(self, name),
                name,
                f"True has no effect: {why}",
                f"set checkpoint.load to the checkpoint directory, or remove checkpoint.{name}",
            )

    def _check_saving_settings(self, problems: Problems) -> None:
        """How often to save and how many saves to keep mean nothing without a save directory.
        Reported when `save` was never given (a forgotten directory: the run would write no
        checkpoint at all); a `save` set to None on purpose turns saving off with its settings."""
        if self.save is not None or self.is_explicit("save"):
            return
        for name, value, default in (("save_interval", self.save_interval, None), ("most_recent_k", self.most_recent_k, -1)):
            problems.check(
                value == default,
                name,
                f"{value} has no effect: checkpoint.save is not set, so no checkpoint is written",
                f"set checkpoint.save to a directory, or remove checkpoint.{name}",
            )
