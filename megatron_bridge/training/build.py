"""Build the model chunks (wrapped in megatron DDP), the optimizer and the LR scheduler."""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch

from megatron_bridge.training.config import OptimizerConfigOverrideProviderContext
from megatron_bridge.peft.apply import apply_peft, check_all_targets_matched

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer
    from megatron_bridge.training.state import GlobalState

logger = logging.getLogger(__name__)


def build_model(cfg: "ConfigContainer", state: "GlobalState") -> list[Any]:
    """One DDP-wrapped `GPTModel` per (virtual) pipeline chunk of this rank.

    The model gets its own copy of the model config: megatron-core stores runtime hooks on it
    (loss scaling, gradient sync), which do not belong in the user's config.
    """
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    model_config = copy.copy(cfg.model)
    model_config.apply_default("timers", state.timers)
    vp = model_config.virtual_pipeline_model_parallel_size
    stages = list(range(vp)) if vp and model_config.pipeline_model_parallel_size > 1 else [None]
    chunks, adapted = [], []
    for vp_stage in stages:
        chunk = model_config.provide(vp_stage=vp_stage)
        if cfg.peft is not None:  # before DDP: it sees only the adapters as trainable

            adapted.append(apply_peft(chunk, cfg.peft, seed=cfg.rng.seed))
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if state.device == "cuda":
            chunk.cuda(torch.cuda.current_device())
        if model_config.fp16 or model_config.bf16:
            chunk = Float16Module(model_config, chunk)
        chunks.append(chunk)
    if cfg.peft is not None:
        check_all_targets_matched(cfg.peft, adapted)
    ddp_config = copy.copy(cfg.ddp)  # megatron-core fills in bucket_size on the object it is given
    wrapped = [
        DistributedDataParallel(
            config=model_config,
            ddp_config=ddp_config,
            module=chunk,
            # Later chunks share the first chunk's bucket schedule (megatron-core convention).
            disable_bucketing=(i > 0) or bool(cfg.optimizer.overlap_param_gather_with_optimizer_step),
        )
        for i, chunk in enumerate(chunks)
    ]
    if cfg.rng.data_parallel_random_init:
        return wrapped
    for model in wrapped:
        model.broadcast_params()
    return wrapped


def count_local_parameters(model: list[Any]) -> int:
    return sum(p.numel() for chunk in model for p in chunk.parameters())


def build_optimizer(cfg: "ConfigContainer", model: list[Any], state: "GlobalState"):
    """megatron-core optimizer over `model` with the param groups from
    `cfg.optimizer_config_override_provider`, and its `OptimizerParamScheduler`."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = copy.copy(cfg.optimizer)
    opt_config.apply_default("timers", state.timers)
    context = OptimizerConfigOverrideProviderContext(
        scheduler_config=cfg.scheduler, optimizer_config=opt_config, model=model
    )
    overrides = cfg.optimizer_config_override_provider.build_config_overrides(context)
    optimizer = get_megatron_optimizer(
        opt_config, model, config_overrides=overrides, use_gloo_process_groups=cfg.dist.use_gloo_process_groups
    )
    s = cfg.scheduler
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=s.lr_warmup_init,
        max_lr=opt_config.lr,
        min_lr=opt_config.min_lr if opt_config.min_lr is not None else 0.0,
        lr_warmup_steps=s.lr_warmup_steps,
        lr_decay_steps=s.lr_decay_steps,
        lr_decay_style=s.lr_decay_style,
        start_wd=s.start_weight_decay,
        end_wd=s.end_weight_decay,
        wd_incr_steps=s.wd_incr_steps,
        wd_incr_style=s.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
        wsd_decay_steps=s.wsd_decay_steps,
        lr_wsd_decay_style=s.lr_wsd_decay_style,
    )
    return optimizer, scheduler


def wire_model_config(cfg: "ConfigContainer", model: list[Any], optimizer: Any) -> None:
    """Hooks megatron-core's schedules call: loss scaling, gradient/param sync, grad finalize."""
    from megatron.core.distributed import finalize_model_grads

    config = model[0].config if hasattr(model[0], "config") else model[0].module.config

    def one_or_list(items: list[Any]) -> Any:
        return items[0] if len(items) == 1 else items

    config.apply_default("grad_scale_func", optimizer.scale_loss)
    if cfg.ddp.overlap_grad_reduce:
        config.apply_default("no_sync_func", one_or_list([m.no_sync for m in model]))
        if cfg.dist.align_grad_reduce:
            config.apply_default("grad_sync_func", one_or_list([m.start_grad_sync for m in model]))
    if cfg.ddp.overlap_param_gather and cfg.ddp.align_param_gather:
        config.apply_default("param_sync_func", one_or_list([m.start_param_sync for m in model]))
    config.apply_default("finalize_model_grads_func", finalize_model_grads)
