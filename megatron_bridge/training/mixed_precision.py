"""Mixed-precision recipes: one config that sets the precision fields of model, optimizer and DDP.

A preset is applied by `runtime_config_update`. It never overwrites a field the user set
explicitly: where the user's value contradicts a field the preset chose (its factory set it),
validation reports it; a field it only carries the class default of takes the user's value. Fields of the
FP8 group are applied only when the preset trains in FP8 (likewise FP4, and loss scaling with
FP16); otherwise the target keeps its own value. A named preset's FP8 parameter gathering
(`fp8_param_gather`) is turned on only with the distributed optimizer, the one megatron-core
optimizer that gathers parameters; the user's own `fp8_param_gather=True` is kept, and refused
by validation without the distributed optimizer.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Callable, Literal, Optional, Union

import torch

from megatron_bridge.config.annotations import field_types, register_section_names
from megatron_bridge.config.base import ConfigBase, config_dataclass, finalize_into
from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError, Problems
from megatron_bridge.config.fields import COUNT, SIZE, field
from megatron_bridge.config.rules import set_unless_user_set

logger = logging.getLogger(__name__)


@config_dataclass(kw_only=True)
class MixedPrecisionConfig(ConfigBase):
    """Precision of parameters, compute, gradients and communication."""

    fp32: bool = False
    """Train in full fp32 (all other precision flags off)."""

    fp16: bool = False
    """fp16 parameters and compute, fp32 main weights in the optimizer, dynamic loss scaling."""

    bf16: bool = False
    """bf16 parameters and compute, fp32 main weights in the optimizer."""

    params_dtype: Optional[torch.dtype] = None
    """dtype of model parameters."""

    pipeline_dtype: Optional[torch.dtype] = None
    """dtype of activations sent between pipeline stages."""

    autocast_dtype: Optional[torch.dtype] = None
    """dtype of autocast regions (default: params_dtype)."""

    grad_reduce_in_fp32: bool = True
    """Accumulate and all-reduce gradients in fp32."""

    fp8: Optional[Literal["e4m3", "hybrid"]] = None
    """FP8 format: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 backward). None: no FP8."""

    fp8_recipe: Literal["tensorwise", "delayed", "mxfp8", "blockwise"] = "tensorwise"
    """FP8 scaling: per-tensor current (tensorwise), delayed (amax history), MX block (mxfp8),
    or sub-channel blockwise."""

    first_last_layers_bf16: bool = False
    """Keep the first and last layers in bf16 when training in FP8."""

    num_layers_at_start_in_bf16: int = field(0, range=COUNT)
    """Layers at the start kept in bf16 (with first_last_layers_bf16)."""

    num_layers_at_end_in_bf16: int = field(0, range=COUNT)
    """Layers at the end kept in bf16 (with first_last_layers_bf16)."""

    fp8_margin: int = field(0, range="[-128, 128]")
    """Margin for FP8 scaling factors."""

    fp8_amax_history_len: int = field(1, range=SIZE)
    """amax history length for delayed scaling."""

    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"
    """How the scale is computed from the amax history."""

    fp8_wgrad: bool = True
    """Compute weight gradients in FP8."""

    fp8_dot_product_attention: bool = False
    """Run dot-product attention in FP8."""

    fp8_multi_head_attention: bool = False
    """Run multi-head attention projections in FP8."""

    fp8_param: Optional[bool] = None
    """Keep parameters in FP8 (default: fp8_param_gather; must equal it when set)."""

    fp8_param_gather: bool = False
    """All-gather parameters in FP8; needs the distributed optimizer (a named preset's True applies
    only with it)."""

    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """Reuse the gradient buffer for the MXFP8 parameter all-gather."""

    fp4: Optional[Literal["e2m1"]] = None
    """FP4 format. None: no FP4."""

    fp4_recipe: Literal["nvfp4", "custom"] = "nvfp4"
    """FP4 scaling recipe: NVFP4 block scaling, or `custom` (the quantizers of
    model.fp4_quantizer_factory)."""

    loss_scale: Optional[float] = field(None, range="(0, 2**32]")
    """Static loss scale (fp16); None: dynamic loss scaling."""

    initial_loss_scale: float = field(4294967296.0, range="(0, 2**64]")
    """Initial dynamic loss scale (fp16)."""

    min_loss_scale: float = field(1.0, range="(0, 2**32]")
    """Lowest dynamic loss scale (fp16)."""

    loss_scale_window: float = field(1000, range=SIZE)
    """Iterations without overflow before the loss scale grows (fp16)."""

    hysteresis: int = field(2, range=SIZE)
    """Overflows tolerated before the loss scale shrinks (fp16)."""

    def _finalize(self, problems: Problems) -> None:
        p = problems
        p.check(not (self.fp16 and self.bf16), "bf16", "fp16 and bf16 are both on", "choose one of them")
        p.check(
            not (self.fp32 and (self.fp16 or self.bf16)),
            "fp32",
            "fp32 is on together with fp16/bf16",
            "choose one precision",
        )
        check_low_precision(self, p, "", "set bf16=True (or fp16=True)")
        if self.fp8_param is None:
            self._derive("fp8_param", self.fp8_param_gather)
        else:
            # model.fp8_param and ddp.fp8_param_gather are one decision: FP8 parameters that are
            # gathered in bf16 (or the reverse) is not a layout megatron-core supports.
            p.check(
                self.fp8_param == self.fp8_param_gather,
                "fp8_param",
                f"fp8_param={self.fp8_param} but fp8_param_gather={self.fp8_param_gather}",
                "set both to the same value, or set only fp8_param_gather (fp8_param follows it)",
            )

    # ------------------------------------------------------------------ applying
    def setup(self, model_config: ConfigBase, optimizer_config: Optional[ConfigBase] = None, ddp_config: Optional[ConfigBase] = None) -> None:
        """Finalize this config and set its fields on the model config and, when given, the
        optimizer and DDP configs, leaving the fields the user set alone (NVIDIA Megatron Bridge's
        entry point; `runtime_config_update` does this). Raises `ConfigValidationError` listing
        every problem, contradictions with the user's values included."""
        problems = Problems()
        finalize_into(self, problems.at("mixed_precision"))
        if not problems:
            self.apply(model_config, optimizer_config, ddp_config, problems, "mixed_precision config")
        problems.raise_if_any()

    def apply(self, model: ConfigBase, optimizer: Optional[ConfigBase], ddp: Optional[ConfigBase], problems: Problems, name: str) -> None:
        """Set the precision fields of model/optimizer/ddp that the user did not set explicitly.

        `problems` collects contradictions between this preset and explicit user values; `name`
        identifies the preset in messages.
        """
        changed: list[str] = []
        preset = self._preset_values()
        if preset.get("fp8_param_gather") and not self._fp8_param_gather_asked(model, ddp):
            # megatron-core gathers parameters (in FP8 or not) only in its distributed optimizer
            if ddp is not None and not ddp.use_distributed_optimizer:
                preset.update(fp8_param_gather=False, fp8_param=False, reuse_grad_buf_for_mxfp8_param_ag=False)
                logger.info(
                    "mixed_precision %r: FP8 parameter gathering left off (it needs the distributed optimizer, "
                    "ddp.use_distributed_optimizer=True)", name,
                )
        for section, target in (("model", model), ("optimizer", optimizer), ("ddp", ddp)):
            if target is None:
                continue

            def clash(field_name: str, current: object, value: object, section: str = section) -> Optional[tuple[str, str]]:
                if not self._chose(field_name):
                    return None  # the preset only carries the default there: the user's value stands
                return (
                    f"{current!r} was set explicitly but mixed_precision {name!r} sets {value!r}",
                    f"remove the explicit {section}.{field_name} or choose another mixed_precision preset",
                )

            values = {k: preset[k] for k in _shared_fields(type(self), type(target)) if k in preset}
            changed += set_unless_user_set(target, values, problems, section, clash, _short)
        if changed:
            logger.info("mixed_precision %r set %s", name, ", ".join(changed))

    def _chose(self, name: str) -> bool:
        """Whether field `name` is this config's choice: set on it explicitly, or set by the preset
        it came from. A class default it merely carries (fp16_mixed's dynamic loss scaling, an FP8
        preset's fp8_dot_product_attention=False) does not contradict a user's own value on the
        model, optimizer or ddp: the user's value stands."""
        return self.is_explicit(name) or name in self.__dict__.get(_PRESET_CHOICES, ())

    def _fp8_param_gather_asked(self, model: ConfigBase, ddp: Optional[ConfigBase]) -> bool:
        """Whether the user asked for FP8 parameter gathering: on this config, ddp or the model."""
        asked = [(self, "fp8_param_gather"), (ddp, "fp8_param_gather"), (model, "fp8_param")]
        return any(
            target is not None and getattr(target, "is_explicit", lambda _: False)(name) and getattr(target, name)
            for target, name in asked
        )

    def _preset_values(self) -> dict:
        """The fields this preset sets, by name: FP8/FP4 details only with FP8/FP4 on, loss
        scaling only with fp16, and a dtype of None keeps the target's own default."""
        on = {None: True, "fp8": self.fp8 is not None, "fp4": self.fp4 is not None, "fp16": self.fp16}
        values = {}
        for name, needs in _field_conditions(type(self)):
            if not on[needs]:
                continue
            value = getattr(self, name)
            if name == "fp8_param" and value is None:
                value = self.fp8_param_gather
            if value is None and name in ("params_dtype", "pipeline_dtype", "autocast_dtype"):
                continue
            values[name] = value
        return values


_FP8_DETAILS = (
    "first_last_layers_bf16",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
    "reuse_grad_buf_for_mxfp8_param_ag",
)
_LOSS_SCALING = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")


@functools.lru_cache(maxsize=None)
def _field_conditions(preset: type) -> tuple[tuple[str, Optional[str]], ...]:
    """(field, the switch it depends on: "fp8", "fp4", "fp16" or None) for a precision config."""

    def needs(name: str) -> Optional[str]:
        if name.startswith("fp8_") or name in _FP8_DETAILS:
            return "fp8"
        if name == "fp4_recipe":
            return "fp4"
        return "fp16" if name in _LOSS_SCALING else None

    return tuple((name, needs(name)) for name in field_types(preset))


@functools.lru_cache(maxsize=None)
def _shared_fields(preset: type, target: type) -> tuple[str, ...]:
    """The fields of a precision config that a target section also has."""
    names = field_types(target)
    return tuple(name for name in field_types(preset) if name in names)


def check_low_precision(c: object, problems: Problems, prefix: str, fix: str) -> None:
    """FP8 and FP4 exclude each other and need bf16/fp16 as the higher precision; `c` is a preset
    or the model (`prefix` "model." names its fields), `fix` says how to add the higher precision."""
    problems.check(
        not (c.fp8 and c.fp4),
        f"{prefix}fp4",
        f"{prefix}fp8={c.fp8!r} and {prefix}fp4={c.fp4!r} are both set",
        "train in FP8 or in FP4, not both",
    )
    if c.fp8 or c.fp4:
        problems.check(
            c.bf16 or c.fp16,
            f"{prefix}fp8" if c.fp8 else f"{prefix}fp4",
            "FP8/FP4 training needs bf16 or fp16 as the higher precision",
            fix,
        )


def _short(value: object) -> str:
    return str(value).replace("torch.", "") if isinstance(value, torch.dtype) else repr(value)


# ---------------------------------------------------------------------- presets
_PRESET_CHOICES = "_mb_preset_choices"
"""Key in a preset's __dict__: the fields its factory set (what a user's different value contradicts)."""


def _as_preset(cfg: MixedPrecisionConfig) -> MixedPrecisionConfig:
    """`cfg` with its values counted as the framework's, not the user's: presets apply them as
    defaults (FP8 parameter gathering, for one, only with the distributed optimizer). The fields
    that were set are remembered as the preset's choices."""
    cfg.__dict__[_PRESET_CHOICES] = frozenset(cfg.__dict__.get(_PRESET_CHOICES, ())) | cfg.explicit_fields()
    for name in cfg.explicit_fields():
        cfg.mark_explicit(name, False)
    return cfg


def fp32() -> MixedPrecisionConfig:
    """Full fp32 training."""
    cfg = MixedPrecisionConfig(fp32=True, params_dtype=torch.float32, pipeline_dtype=torch.float32, grad_reduce_in_fp32=True)
    return _as_preset(cfg)


def bf16_mixed() -> MixedPrecisionConfig:
    """bf16 parameters and compute, fp32 main weights and gradient reduction."""
    # fp16=False is a choice too: a user's explicit fp16=True contradicts this preset by name
    cfg = MixedPrecisionConfig(bf16=True, fp16=False, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, grad_reduce_in_fp32=True)
    return _as_preset(cfg)


def fp16_mixed() -> MixedPrecisionConfig:
    """fp16 parameters and compute with dynamic loss scaling."""
    cfg = MixedPrecisionConfig(fp16=True, bf16=False, params_dtype=torch.half, pipeline_dtype=torch.half, grad_reduce_in_fp32=False)
    return _as_preset(cfg)


def _with(base: Callable[[], MixedPrecisionConfig], **fp_fields) -> MixedPrecisionConfig:
    cfg = base()
    for key, value in fp_fields.items():
        setattr(cfg, key, value)
    return _as_preset(cfg)


_DELAYED = dict(fp8="hybrid", fp8_recipe="delayed", fp8_margin=0, fp8_amax_history_len=1024, fp8_amax_compute_algo="max", fp8_param_gather=True)
_CURRENT = dict(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1, fp8_param_gather=True)
# MXFP8 scales each 32-element block, so e4m3 everywhere loses nothing the hybrid format would keep;
# parameters are gathered in FP8 into the gradient buffer, which is free during the all-gather.
_MXFP8 = dict(fp8="e4m3", fp8_recipe="mxfp8", fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True)
_BLOCKWISE = dict(fp8="hybrid", fp8_recipe="blockwise", fp8_param_gather=False)


def bf16_with_fp8_delayed_scaling_mixed() -> MixedPrecisionConfig:
    """bf16 with FP8 (hybrid) matmuls, delayed scaling over a 1024-step amax history."""
    return _with(bf16_mixed, **_DELAYED)


def fp16_with_fp8_delayed_scaling_mixed() -> MixedPrecisionConfig:
    """fp16 with FP8 (hybrid) matmuls, delayed scaling."""
    return _with(fp16_mixed, **_DELAYED)


def bf16_with_fp8_current_scaling_mixed() -> MixedPrecisionConfig:
    """bf16 with FP8 (hybrid) matmuls, per-tensor current scaling; first and last layer in bf16."""
    return _with(bf16_mixed, **_CURRENT)


def fp16_with_fp8_current_scaling_mixed() -> MixedPrecisionConfig:
    """fp16 with FP8 (hybrid) matmuls, per-tensor current scaling; first and last layer in fp16."""
    return _with(fp16_mixed, **_CURRENT)


def bf16_with_mxfp8_mixed() -> MixedPrecisionConfig:
    """bf16 with MXFP8 (e4m3) block-scaled matmuls (Blackwell); parameters gathered in FP8 through
    the gradient buffer."""
    return _with(bf16_mixed, **_MXFP8)


def fp16_with_mxfp8_mixed() -> MixedPrecisionConfig:
    """fp16 with MXFP8 (e4m3) block-scaled matmuls (Blackwell); parameters gathered in FP8 through
    the gradient buffer."""
    return _with(fp16_mixed, **_MXFP8)


def bf16_with_fp8_subchannel_scaling_mixed() -> MixedPrecisionConfig:
    """bf16 with FP8 (hybrid) sub-channel (blockwise) scaling."""
    return _with(bf16_mixed, **_BLOCKWISE)


def fp16_with_fp8_subchannel_scaling_mixed() -> MixedPrecisionConfig:
    """fp16 with FP8 (hybrid) sub-channel (blockwise) scaling."""
    return _with(fp16_mixed, **_BLOCKWISE)


def bf16_with_nvfp4_mixed() -> MixedPrecisionConfig:
    """bf16 with NVFP4 matmuls (Blackwell)."""
    return _with(bf16_mixed, fp4="e2m1", fp4_recipe="nvfp4")


PRESETS: dict[str, Callable[[], MixedPrecisionConfig]] = {
    f.__name__: f
    for f in (
        fp32,
        bf16_mixed,
        fp16_mixed,
        bf16_with_fp8_delayed_scaling_mixed,
        fp16_with_fp8_delayed_scaling_mixed,
        bf16_with_fp8_current_scaling_mixed,
        fp16_with_fp8_current_scaling_mixed,
        bf16_with_mxfp8_mixed,
        fp16_with_mxfp8_mixed,
        bf16_with_fp8_subchannel_scaling_mixed,
        fp16_with_fp8_subchannel_scaling_mixed,
        bf16_with_nvfp4_mixed,
    )
}
"""The preset registry: name -> function returning a fresh `MixedPrecisionConfig`."""

MIXED_PRECISION_RECIPES = PRESETS
"""The registry under the name NVIDIA Megatron Bridge gives it."""


def register_preset(name: str, factory: Callable[[], MixedPrecisionConfig]) -> None:
    """Add a preset (e.g. from a user package) under `name`."""
    PRESETS[_normalize(name)] = factory


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def get_mixed_precision_config(name_or_config: Union[str, MixedPrecisionConfig]) -> MixedPrecisionConfig:
    """A preset by name ('bf16_mixed', 'bf16-mixed', ...) or the given config unchanged."""
    if isinstance(name_or_config, MixedPrecisionConfig):
        return name_or_config
    key = _normalize(str(name_or_config))
    if key not in PRESETS:
        raise ConfigValidationError(
            ConfigProblem(
                "mixed_precision",
                f"unknown preset {name_or_config!r}",
                "use one of: " + ", ".join(sorted(PRESETS)),
            )
        )
    factory = PRESETS[key]
    cached = _PROTOTYPES.get(key)
    if cached is None or cached[0] is not factory:
        cached = _PROTOTYPES[key] = (factory, factory())
    # Every field is a scalar or dtype, so a shallow copy is independent of the prototype.
    return _as_preset(copy.copy(cached[1]))  # a registered factory's values are the framework's too


_PROTOTYPES: dict[str, tuple[Callable[[], MixedPrecisionConfig], MixedPrecisionConfig]] = {}
"""name -> (factory, what it returned): each preset is built once; configs get copies."""

register_section_names(MixedPrecisionConfig, get_mixed_precision_config)  # `mixed_precision=bf16_mixed`
