"""What each config field does at run time: **used**, **derived**, or **unsupported** (with why).

* **used**: the runtime reads it (our code, or megatron-core, which receives the fields our
  classes inherit from its config classes).
* **derived**: a rule computes it from other fields (`init=False` fields); users do not set it.
* **unsupported**: accepted for compatibility with configs written for other systems, but not
  honoured here. Setting it to anything but its default is a `ConfigValidationError` naming the
  reason. Reasons about the machine ("needs a GPU", "needs TransformerEngine") are not config
  errors: a dry run plans such a config and reports "would fail on this machine"; the real run
  refuses it before building the model (`machine_problems`).

The tables are data, keyed by the config class that declares the field (its first class in the
method resolution order that is one of ours). `docs/unsupported-fields.md` is generated from them
by `tools/gen_unsupported_fields.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from megatron_bridge.config.annotations import values_equal
from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError, Problems
from megatron_bridge import extras

USED = "used"
DERIVED = "derived"


@dataclass(frozen=True)
class Unsupported:
    """A field that is accepted but not honoured; `reason` says why (and what to use instead)."""

    reason: str
    needs: str | None = None
    """`"gpu"` or `"transformer_engine"` when only the machine is missing; None otherwise."""


Status = str | Unsupported

_NOT_IMPLEMENTED = "not implemented"
_NON_PERSISTENT = Unsupported(
    "non-persistent checkpoints are not implemented (megatron-core 0.16.1 has no manager for them); "
    "use checkpoint.save_interval"
)
_FIM = Unsupported("megatron-core 0.16.1 has no fill-in-the-middle dataset; use GPTDatasetConfig")
_TENSOR_INSPECT = Unsupported(
    "tensor inspection is not implemented (it needs TransformerEngine's debug API, nvdlfw_inspect)"
)
_FSDP_ONLY = Unsupported("read only by Megatron FSDP, which is not wired into the model build")
NEEDS_TE = Unsupported("needs TransformerEngine", needs="transformer_engine")
NEEDS_GPU = Unsupported("needs a GPU (CUDA graphs)", needs="gpu")

UNSUPPORTED: dict[str, dict[str, Unsupported]] = {
    "CheckpointConfig": {
        "load_main_params_from_ckpt": Unsupported(
            f"{_NOT_IMPLEMENTED}: fp32 main parameters are always re-derived from the model weights"
        ),
        "non_persistent_save_interval": _NON_PERSISTENT,
        "non_persistent_ckpt_type": _NON_PERSISTENT,
        "non_persistent_global_ckpt_dir": _NON_PERSISTENT,
        "non_persistent_local_ckpt_dir": _NON_PERSISTENT,
        "non_persistent_local_ckpt_algo": _NON_PERSISTENT,
        "ckpt_format": Unsupported(
            "only torch_dist checkpoints are written: zarr is deprecated in megatron-core, "
            "fsdp_dtensor needs Megatron FSDP; use torch_dist"
        ),
        "async_strategy": Unsupported(f"{_NOT_IMPLEMENTED}: async saves always use megatron-core's writer"),
        "async_write_results_mp_mode": Unsupported(
            f"{_NOT_IMPLEMENTED}: megatron-core's async writer chooses its own start method"
        ),
        "strict_fsdp_dtensor_load": Unsupported(
            "fsdp_dtensor checkpoints are not supported; use ckpt_format=torch_dist"
        ),
        "save_tokenizer_assets": Unsupported(f"{_NOT_IMPLEMENTED}: checkpoints do not include the tokenizer files"),
    },
    "GPTFIMDatasetConfig": {
        name: _FIM
        for name in (
            "fim_rate",
            "fim_spm_rate",
            "fim_extra_tokens",
            "fim_split_sample",
            "fim_fragment_rate",
            "fim_no_prefix",
        )
    },
    "DistributedInitConfig": {
        "distributed_timeout_seconds_after_init": Unsupported(f"{_NOT_IMPLEMENTED}: use distributed_timeout_minutes"),
        "lazy_mpu_init": Unsupported(f"{_NOT_IMPLEMENTED}: process groups are always created at setup"),
        "disable_jit_fuser": Unsupported(_NOT_IMPLEMENTED),
        "enable_megatron_core_experimental": Unsupported(_NOT_IMPLEMENTED),
        "use_decentralized_pg": Unsupported(f"{_NOT_IMPLEMENTED}: megatron-core's global process groups are used"),
        "use_torch_fsdp2": Unsupported(
            f"{_NOT_IMPLEMENTED}: models are wrapped with megatron DDP; use ddp.use_distributed_optimizer=True"
        ),
    },
    "DistributedDataParallelConfig": {
        "use_megatron_fsdp": Unsupported(
            f"{_NOT_IMPLEMENTED}: Megatron FSDP is not wired into the model build; use use_distributed_optimizer"
        ),
        **{
            name: _FSDP_ONLY
            for name in (
                "use_custom_fsdp",
                "data_parallel_sharding_strategy",
                "gradient_reduce_div_fusion",
                "suggested_communication_unit_size",
                "preserve_fp32_weights",
                "keep_fp8_transpose_cache",
                "fsdp_double_buffer",
                "outer_dp_sharding_strategy",
                "fsdp_manual_registration",
            )
        },
        "param_name_patterns_for_fp32_local_accumulation": Unsupported(
            f"{_NOT_IMPLEMENTED}: megatron-core 0.16.1 has no such option"
        ),
    },
    "TrainingConfig": {
        "empty_unused_memory_level": Unsupported(f"{_NOT_IMPLEMENTED}: the CUDA cache is never emptied by the loop"),
        "check_weight_hash_across_dp_replicas_interval": Unsupported(_NOT_IMPLEMENTED),
        "train_sync_interval": Unsupported(_NOT_IMPLEMENTED),
        "exit_signal_handler_for_dataloader": Unsupported(_NOT_IMPLEMENTED),
        "check_optimizer_step_success": Unsupported(
            f"{_NOT_IMPLEMENTED}: a failed step is reported by the skipped-iterations count"
        ),
        "skip_sync_grad_norm_across_mp": Unsupported(_NOT_IMPLEMENTED),
        "decrease_batch_size_if_needed": Unsupported(
            "the global batch size is used as given: sample counters, the learning-rate schedule and the "
            "samplers count train.global_batch_size, so a batch that megatron-core rounded down would be "
            "counted wrongly; make global_batch_size a multiple of micro_batch_size x data-parallel size"
        ),
    },
    "LoggerConfig": {
        "timing_log_option": Unsupported(
            f"{_NOT_IMPLEMENTED}: timers are reported as their maximum over ranks (`<name>-time`); "
            "megatron-core's timer report, which this option formats, is not produced"
        ),
    },
    "TensorInspectConfig": {
        name: _TENSOR_INSPECT for name in ("enabled", "features", "feature_dirs", "log_dir", "init_training_step")
    },
    "GPTModelProvider": {
        "fp8": NEEDS_TE,
        "fp4": NEEDS_TE,
        "enable_cuda_graph": NEEDS_GPU,
        "cuda_graph_impl": NEEDS_GPU,
        "external_cuda_graph": NEEDS_GPU,
    },
}
"""Fields accepted but not honoured, by declaring class."""

DERIVED_FIELDS: dict[str, frozenset[str]] = {
    # megatron-core hooks that the build wires onto the model's copy of the config.
    "GPTModelProvider": frozenset(
        {"timers", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func"}
    ),
    "OptimizerConfig": frozenset({"timers"}),  # set by the optimizer build on its copy
}
"""Fields a rule computes although megatron-core lets them be passed, by declaring class."""

UNSUPPORTED_CLASSES: dict[str, Unsupported] = {"GPTFIMDatasetConfig": _FIM}
"""Config classes that cannot be used at all (the run would silently do something else)."""

GENERIC_MCORE_TEST = "tests/test_field_status.py::test_megatron_core_fields_reach_megatron_core"
"""The test that shows fields inherited from megatron-core reach the megatron-core object."""


# ---------------------------------------------------------------------- lookups
def _config_base() -> type:
    # config.base runs the unsupported-field check of this module in every finalize, so this
    # module reads ConfigBase when it first needs it rather than importing it.
    from megatron_bridge.config.base import ConfigBase

    return ConfigBase


@functools.cache
def declaring_class(cls: type, name: str) -> type:
    """The first of our config classes (from the base down) that has field `name`."""
    ours = _config_base()
    for klass in reversed(cls.__mro__):
        if issubclass(klass, ours) and name in getattr(klass, "__dataclass_fields__", {}):
            return klass
    return cls


@functools.cache
def from_megatron_core(cls: type, name: str) -> bool:
    """True if `name` is a field of a megatron-core dataclass that `cls` inherits from (ours live in
    megatron_bridge, never in a `megatron.` module)."""
    return any(k.__module__.startswith("megatron.") and name in getattr(k, "__dataclass_fields__", {}) for k in cls.__mro__)


@functools.cache
def status_of(cls: type, name: str) -> Status:
    """The status of field `name` of config class `cls`."""
    owner = declaring_class(cls, name)
    unsupported = UNSUPPORTED.get(owner.__name__, {}).get(name)
    if unsupported is not None:
        return unsupported
    f = cls.__dataclass_fields__[name]
    if not f.init or name in DERIVED_FIELDS.get(owner.__name__, ()):
        return DERIVED
    return USED


@functools.cache
def _unsupported_fields(cls: type) -> tuple[tuple[str, Any, Unsupported], ...]:
    """(name, default, why) of each unsupported field of `cls`; the default is computed once
    (dataclasses.MISSING when the field has none)."""
    found = []
    for f in dataclasses.fields(cls):
        status = status_of(cls, f.name)
        if isinstance(status, Unsupported):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            found.append((f.name, default, status))
    return tuple(found)


@functools.cache
def _refused_fields(cls: type) -> tuple[tuple[str, Any, Unsupported], ...]:
    """`_unsupported_fields` whose reason is not the machine: a config error anywhere."""
    return tuple(entry for entry in _unsupported_fields(cls) if entry[2].needs is None)


def _changed(config: Any, fields: tuple[tuple[str, Any, Unsupported], ...]) -> Iterator[tuple[str, Any, Unsupported]]:
    values = config.__dict__
    for name, default, why in fields:
        value = values.get(name, default)
        if value is not default and (default is dataclasses.MISSING or not values_equal(value, default)):
            yield name, value, why


def unsupported_settings(config: Any) -> Iterator[tuple[str, Any, Unsupported]]:
    """(field, value, why) for each unsupported field of `config` set to a non-default value,
    and ("", class name, why) when the class itself is unsupported."""
    cls = type(config)
    why = UNSUPPORTED_CLASSES.get(cls.__name__)
    if why is not None:
        yield "", cls.__name__, why
    yield from _changed(config, _unsupported_fields(cls))


def check_unsupported(config: Any, problems: Problems) -> None:
    """Report unsupported settings of one section into `problems` (machine reasons excepted)."""
    cls = type(config)
    refused = _refused_fields(cls)
    why = UNSUPPORTED_CLASSES.get(cls.__name__)
    if why is not None and why.needs is None:
        problems.add("", f"{cls.__name__} is not supported: {why.reason}", "use another config class")
    if refused:  # most classes have none: no generator for them (this runs for every section)
        for name, value, why in _changed(config, refused):
            problems.add(name, f"{name}={value!r} is not supported: {why.reason}", "leave it at its default")


def machine_problems(cfg: Any, device: Optional[str] = None) -> list[str]:
    """Settings of `cfg` this machine cannot run (no GPU, no TransformerEngine), as messages.
    `device`: where the run trains ("cpu" also on a machine with GPUs); default: a GPU if any."""
    return [str(p) for p in _machine_problems(cfg, device)]


def refuse_on_this_machine(cfg: Any, device: Optional[str] = None) -> None:
    """Raise `ConfigValidationError` listing the settings this machine cannot run (on `device`)."""
    found = _machine_problems(cfg, device)
    if found:
        raise ConfigValidationError(found)


def _machine_problems(cfg: Any, device: Optional[str]) -> list[ConfigProblem]:
    has_gpu = _has_gpu()
    on_gpu = has_gpu if device is None else device == "cuda"
    found = []
    for section_name, section in sections(cfg):
        for name, value, why in unsupported_settings(section):
            if why.needs == "transformer_engine" and not extras.is_installed("transformer_engine"):
                fix = "pip install transformer-engine, or leave it unset"
            elif why.needs == "gpu" and not on_gpu:
                where = "train on the GPUs (dist.distributed_backend=auto or nccl)" if has_gpu else "run on a machine with a GPU"
                fix = f"{where}, or leave it unset"
            else:
                continue
            found.append(ConfigProblem(f"{section_name}.{name}", f"{name}={value!r} {why.reason}", fix))
    return found


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def sections(cfg: Any) -> Iterator[tuple[str, Any]]:
    """(name, section) for each config section of a container (nested config values included)."""
    ours = _config_base()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name, None)
        if isinstance(value, ours):
            yield f.name, value
