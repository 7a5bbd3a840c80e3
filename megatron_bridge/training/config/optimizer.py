"""The optimizer, and the hook that decides per-parameter-group settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from megatron.core.optimizer import OptimizerConfig as MCoreOptimizerConfig, get_standard_config_overrides

from megatron_bridge.config.base import ConfigBase, config_dataclass
from megatron_bridge.config.errors import Problems
from megatron_bridge.training.config.scheduler import SchedulerConfig

SUPPORTED_OPTIMIZERS = ("adam", "sgd")


@config_dataclass
class OptimizerConfig(MCoreOptimizerConfig, ConfigBase):
    """Megatron Core OptimizerConfig with deferred post-init.

    Construction stores values only; `finalize()` runs megatron-core's checks and derived values.
    """

    def __post_init__(self) -> None:
        """Skip megatron-core's post-init; `finalize()` runs it."""

    def _finalize(self, problems: Problems) -> None:
        # lr is in its range [0, 10] here; 0 is a run that computes gradients and changes nothing
        if problems.check(self.lr is not None, "lr", "the learning rate is not set", "set optimizer.lr, e.g. 3e-4"):
            if self.min_lr is None:
                # megatron-core copies min_lr into every param group; its scheduler fails on None
                self._derive("min_lr", 0.0)
            else:
                problems.check(
                    0.0 <= self.min_lr <= self.lr,
                    "min_lr",
                    f"min_lr ({self.min_lr}) must be within [0, lr={self.lr}]",
                    "lower optimizer.min_lr",
                )
        problems.check(
            self.optimizer in SUPPORTED_OPTIMIZERS,
            "optimizer",
            f"unknown optimizer {self.optimizer!r}",
            f"use one of {list(SUPPORTED_OPTIMIZERS)}",
        )
        if self.use_precision_aware_optimizer:
            problems.check(
                self.optimizer == "adam",
                "use_precision_aware_optimizer",
                "the precision-aware optimizer only supports adam",
                "set optimizer.optimizer='adam'",
            )
            problems.check(
                self.use_distributed_optimizer,
                "use_precision_aware_optimizer",
                "the precision-aware optimizer needs the distributed optimizer",
                "set ddp.use_distributed_optimizer=True",
            )
            if not self.optimizer_cpu_offload:  # else megatron-core's hybrid CPU/GPU optimizer serves it
                problems.require_package(
                    "transformer_engine", "use_precision_aware_optimizer", "the precision-aware optimizer (TransformerEngine's FusedAdam)"
                )
        else:
            for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
                value = getattr(self, name)
                problems.check(
                    value == torch.float32,
                    name,
                    f"{value} needs the precision-aware optimizer",
                    f"set optimizer.use_precision_aware_optimizer=True or {name}=torch.float32",
                )
        self._check_loss_scaling(problems)
        if not problems:
            self._run_parent_post_init(MCoreOptimizerConfig, problems)

    def _check_loss_scaling(self, problems: Problems) -> None:
        """megatron-core scales the loss only in fp16/bf16 runs: by `loss_scale` where set, else
        dynamically in fp16 alone (the other loss-scaling fields); elsewhere they do nothing."""
        if self.loss_scale is not None and not (self.fp16 or self.bf16):
            problems.add(
                "loss_scale",
                f"{self.loss_scale} has no effect in an fp32 run (megatron-core scales the loss only with fp16 or bf16)",
                "use a mixed_precision preset (e.g. fp16_mixed), or remove optimizer.loss_scale",
            )
        dynamic = self.fp16 and self.loss_scale is None
        for name in () if dynamic else _DYNAMIC_SCALING:
            value, default = getattr(self, name), MCoreOptimizerConfig.__dataclass_fields__[name].default
            if value != default:
                why = "a constant loss_scale is set" if self.fp16 else "dynamic loss scaling is fp16's alone"
                problems.add(name, f"{value} has no effect: {why}", f"leave optimizer.{name} at {default}")


_DYNAMIC_SCALING = ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
"""The settings of megatron-core's dynamic loss scaler (fp16 without a constant loss_scale)."""


@dataclass
class OptimizerConfigOverrideProviderContext:
    """What an `OptimizerConfigOverrideProvider` may look at to decide parameter groups."""

    scheduler_config: SchedulerConfig = None
    optimizer_config: OptimizerConfig = None
    model: Union[Any, list[Any]] = None


@config_dataclass
class OptimizerConfigOverrideProvider(ConfigBase):
    """Decides per-parameter-group optimizer settings (megatron-core `ParamKey` ->
    `ParamGroupOverride`). Subclass it and put an instance in `cfg.optimizer_config_override_provider`
    to change the groups `pretrain()` builds."""

    def build_config_overrides(self, context: OptimizerConfigOverrideProviderContext) -> Optional[dict]:
        """By default weight decay is skipped for biases and 1-D parameters (norm weights), except
        q/k layernorms when `optimizer.apply_wd_to_qk_layernorm` is set; `optimizer.decoupled_lr`
        gives embedding and output layers their own learning rate."""
        return get_standard_config_overrides(context.optimizer_config)
