"""`runtime_config_update`: every rule that resolves a config, declared once, in the order it runs.

`RULES` is the whole story of how a config becomes runnable: presets, the device adaptation,
deprecated aliases, syncs between sections, each section's finalize, derived values and checks.
`mbridge config rules` prints it. `ConfigContainer.validate()` runs the rules marked `validate`;
`runtime_config_update` runs them all. The engine (`megatron_bridge.config.rules`) owns the
policies: "set unless the user did", remembered derived values, and read-only checks.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from megatron_bridge.config import ranges
from megatron_bridge.config.base import finalize_into
from megatron_bridge.config.errors import ConfigValidationError, Problems
from megatron_bridge.config.rules import Rule, run_rules
from megatron_bridge.data.rules import check_data_rules
from megatron_bridge.config.secrets import printable
from megatron_bridge.models.experts import adapt_expert_mlp
from megatron_bridge.models.hf import checks as hf_checks
from megatron_bridge.models.vocab import derive_vocab_size
from megatron_bridge.peft.apply import check_config as check_peft_config
from megatron_bridge.training.config.architecture import check_ckpt_step_is_loaded, check_loaded_architectures
from megatron_bridge.training.config.profiling import check_profiled_window
from megatron_bridge.training.config import checks, env_vars, run_rules as run_schedule
from megatron_bridge.runtime import cpu_backend
from megatron_bridge.training.mixed_precision import get_mixed_precision_config
from megatron_bridge.runtime.launcher_env import launcher_int

if TYPE_CHECKING:
    from megatron_bridge.training.config.container import ConfigContainer

logger = logging.getLogger(__name__)

# Sections in the order validate() finalizes them (the model first: others read its derived values).
SECTIONS = (
    "model",
    "train",
    "validation",
    "optimizer",
    "scheduler",
    "ddp",
    "dataset",
    "tokenizer",
    "checkpoint",
    "logger",
    "dist",
    "rng",
    "rerun_state_machine",
    "profiling",
    "mixed_precision",
    "comm_overlap",
    "ft",
    "straggler",
    "nvrx_straggler",
    "inprocess_restart",
    "tensor_inspect",
    "optimizer_config_override_provider",
    "peft",
)


def current_world_size() -> int:
    """World size of the initialized process group, else WORLD_SIZE, else 1."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except Exception:  # a broken distributed build must not break config handling
        pass
    return launcher_int("WORLD_SIZE", 1)



def runtime_config_update(
    cfg: "ConfigContainer", world_size: Optional[int] = None, device: Optional[str] = None
) -> None:
    """Resolve `cfg` for a run on `world_size` processes, then validate it; raise one
    `ConfigValidationError` for everything found. Runs every rule of `RULES` in order.

    `world_size` defaults to the process group's, else WORLD_SIZE, else 1. `device="cpu"` also
    adapts the config to CPU training (fused CUDA kernels off, ...); any other value (or None)
    leaves the config as it would run on GPUs. Calling it again gives the same result.
    """
    problems = Problems()
    inputs = {
        "world_size": current_world_size() if world_size is None else world_size,
        "device": device,
        "presets": True,  # the preset rules run (and finalize mixed_precision and comm_overlap)
    }
    run_rules(RULES, cfg, problems, inputs)
    problems.raise_if_any()


def validate_into(cfg: "ConfigContainer", problems: Problems) -> None:
    """The rules `ConfigContainer.validate()` runs: everything but presets, world size and device."""
    run_rules([rule for rule in RULES if rule.validate], cfg, problems, {})


# ---------------------------------------------------------------------- rules
def check_env_vars(cfg: "ConfigContainer", problems: Problems) -> None:
    """`env_vars` holds names and scalar values the environment can take, within the size the
    operating system passes on, and no variable that makes a process load code (PYTHONPATH,
    LD_PRELOAD, BASH_ENV, ...; `training.config.env_vars` lists them with the reasons)."""
    env_vars.check(cfg.env_vars, problems.at("env_vars"))


def apply_env_vars(cfg: "ConfigContainer", problems: Problems) -> None:
    """Set `env_vars` in the environment (all of them, or none when one is refused); variables
    the environment already has win."""
    if not cfg.env_vars:
        return
    refused = Problems()
    env_vars.check(cfg.env_vars, refused)  # reported by the check rule
    if refused:
        return
    for name, value in cfg.env_vars.items():
        if name in os.environ and os.environ[name] != str(value):
            logger.info(
                "env_vars.%s=%s not applied: the environment already has %s",
                name, printable(name, value), printable(name, os.environ[name]),
            )  # fmt: skip
        os.environ.setdefault(name, str(value))


def apply_mixed_precision(cfg: "ConfigContainer", problems: Problems) -> None:
    """Resolve `mixed_precision` (a preset name or config) and set its fields on model, optimizer
    and ddp, leaving the fields the user set alone."""
    if cfg.mixed_precision is None:
        return
    name = cfg.mixed_precision if isinstance(cfg.mixed_precision, str) else "mixed_precision config"
    try:
        mp = get_mixed_precision_config(cfg.mixed_precision)
    except ConfigValidationError as exc:
        problems.absorb(exc)
        return
    cfg.apply_default("mixed_precision", mp)
    before = len(problems)
    finalize_into(mp, problems.at("mixed_precision"))
    if len(problems) == before:
        mp.apply(cfg.model, cfg.optimizer, cfg.ddp, problems, name)


def apply_comm_overlap(cfg: "ConfigContainer", problems: Problems) -> None:
    """Finalize `comm_overlap` for the data-parallel size and set its fields on model, ddp and
    optimizer, leaving the fields the user set alone."""
    if cfg.comm_overlap is None or cfg.data_parallel_size is None:
        return
    before = len(problems)
    finalize_into(cfg.comm_overlap, problems.at("comm_overlap"))
    if len(problems) == before:
        cfg.comm_overlap.apply(cfg.model, cfg.ddp, cfg.optimizer, problems)


def adapt_to_cpu(cfg: "ConfigContainer", problems: Problems) -> None:
    """Make the config trainable on CPU: fused CUDA kernels off, megatron-core's local layers,
    CPU initialization (unless the user chose otherwise); refuse GPU-only tools."""
    cpu_backend.adapt_config(cfg, problems)


def data_parallel_size_for(model: Any, world: Any, problems: Problems) -> Optional[int]:
    """world // (TP x PP x CP) of `model`, or None with the reason added to `problems`."""
    fix = "launch a multiple of TP x PP x CP processes or change the parallel sizes"
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        problems.add("data_parallel_size", f"world size {world!r} is not a positive number of processes", fix)
        return None
    m = model
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    if model_parallel <= 0 or world % model_parallel != 0:
        sizes = f"{m.tensor_model_parallel_size} x {m.pipeline_model_parallel_size} x {m.context_parallel_size}"
        problems.add(
            "data_parallel_size",
            f"world size {world} is not divisible by tensor x pipeline x context parallel = {sizes}",
            fix,
        )
        return None
    return world // model_parallel


def derive_data_parallel_size(cfg: "ConfigContainer", problems: Problems, world_size: Optional[int] = None) -> None:
    """`data_parallel_size` = world size // (TP x PP x CP); `validate()` alone computes it only if
    unset (for the current world size)."""
    if world_size is None and cfg.data_parallel_size is not None:
        return
    world = current_world_size() if world_size is None else world_size
    dp = data_parallel_size_for(cfg.model, world, problems)
    if dp is None:
        return
    m = cfg.model
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    if cfg.is_explicit("data_parallel_size") and cfg.data_parallel_size != dp:
        problems.add(
            "data_parallel_size",
            f"set to {cfg.data_parallel_size}, but {world} ranks with TP x PP x CP = {model_parallel} give {dp}",
            "leave data_parallel_size unset (it is derived), or launch the matching number of ranks",
        )
        return
    cfg.apply_default("data_parallel_size", dp)
    if cfg.comm_overlap is not None:
        cfg.comm_overlap.apply_default("data_parallel_size", dp)


def finalize_sections(cfg: "ConfigContainer", problems: Problems, presets: Optional[bool] = None) -> None:
    """Each section's own checks and derived values (the model first: others read its derived
    values), and the range of every number in the container itself."""
    ranges.check(cfg, problems)
    for name in SECTIONS:
        if presets and name in ("mixed_precision", "comm_overlap"):
            continue  # their preset rules just finalized them
        section = getattr(cfg, name)
        if section is None or isinstance(section, str):
            continue
        if name == "comm_overlap" and section.data_parallel_size is None:
            continue  # reported as data_parallel_size
        finalize_into(section, problems.at(name))


RULES: tuple[Rule, ...] = (
    Rule("environment variables", "setup", apply_env_vars, validate=False),
    Rule("CPU adaptation", "adapt", adapt_to_cpu, validate=False, device="cpu"),
    Rule("expert MLP", "adapt", adapt_expert_mlp, validate=False, device="cuda"),
    Rule("distributed optimizer", "sync", checks.sync_distributed_optimizer),
    Rule("TransformerEngine RNG tracker", "sync", checks.sync_te_rng_tracker),
    Rule("mixed precision", "preset", apply_mixed_precision, validate=False),
    Rule("data-parallel size", "derive", derive_data_parallel_size, inputs=("world_size",)),
    Rule("communication overlap", "preset", apply_comm_overlap, validate=False),
    Rule("deprecated training fields", "alias", checks.apply_deprecated_training_fields),
    Rule("overlapped parameter gather", "sync", checks.sync_overlap_param_gather),
    Rule("pretrained model's tokenizer", "preset", hf_checks.apply_pretrained_defaults),
    Rule("sections", "finalize", finalize_sections, inputs=("presets",)),
    Rule("evaluation batch sizes", "derive", checks.derive_eval_batch_sizes),
    Rule("vocabulary size", "derive", derive_vocab_size),
    Rule("batch sizes", "check", checks.check_batch_sizes),
    Rule("pipeline layout", "check", checks.check_pipeline_layout),
    Rule("distributed optimizer instances", "check", checks.check_distributed_optimizer_instances),
    Rule("mixed precision consistency", "check", checks.check_mixed_precision_consistency),
    Rule("weight initialization", "check", checks.check_initialization),
    Rule("output logits", "check", checks.check_output_logits),
    Rule("sequence lengths", "check", checks.check_sequence_lengths),
    Rule("context parallelism", "check", checks.check_context_parallel),
    Rule("deterministic mode", "check", checks.check_deterministic_mode),
    Rule("adapters", "check", check_peft_config),
    Rule("Hugging Face weights", "check", checks.check_hugging_face),
    Rule("checkpoint architecture", "check", check_loaded_architectures),
    Rule("checkpoint step", "check", check_ckpt_step_is_loaded),
    Rule("vocabulary", "check", checks.check_vocab),
    Rule("logger outputs", "check", checks.check_logger_outputs),
    Rule("environment variables", "check", check_env_vars),
    Rule("data blends and phases", "check", check_data_rules),
    Rule("fp8 parameter gather", "check", run_schedule.check_fp8_param_sync),
    Rule("fp8 parameter gather optimizer", "check", run_schedule.check_fp8_param_gather_optimizer),
    Rule("mxfp8 parameter gather buffer", "check", run_schedule.check_mxfp8_param_gather_reuse),
    Rule("parameter gather in the optimizer step", "check", run_schedule.check_param_gather_with_optimizer_step),
    Rule("context-parallel fine-tuning", "check", run_schedule.check_context_parallel_finetuning),
    Rule("schedule length", "check", run_schedule.check_schedule_length),
    Rule("warmup start", "check", run_schedule.check_warmup_start),
    Rule("profiled window", "check", check_profiled_window),
    Rule("recipe warmup", "derive", run_schedule.derive_recipe_warmup),
    Rule("weight decay schedule", "derive", checks.derive_weight_decay),
    Rule("scheduler steps", "derive", checks.derive_scheduler_steps),
    Rule("resumed schedule", "derive", run_schedule.derive_resume_schedule),
)
"""Every rule, in the order it runs."""
