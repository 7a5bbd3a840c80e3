"""Overlap of communication with computation, derived from the parallel layout.

`runtime_config_update` finalizes this after the data-parallel size is known and applies it to
the model, DDP and optimizer configs. Precedence: a field the user set explicitly on the target
config wins; then a value set explicitly here; then the default derived from the layout.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

from megatron_bridge.config.base import ConfigBase, config_dataclass, finalize_into
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.fields import COUNT, INTERVAL, SIZE, field
from megatron_bridge.config.rules import set_unless_user_set
from megatron_bridge.config.yaml_input import load_file
from megatron_bridge.extras import is_installed, require

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_SIZE = 128 * 1024 * 1024
"""Gradient bucket size (parameters) used when data-parallel overlap is on."""


@config_dataclass(kw_only=True)
class CommOverlapConfig(ConfigBase):
    """Which communication to overlap with computation. None means: derive from the layout."""

    tp_comm_overlap: bool = False
    """Overlap tensor-parallel communication with GEMMs (needs TP >= 2, sequence parallelism and
    TransformerEngine; otherwise turned off with a warning)."""

    tp_comm_overlap_cfg: Optional[Union[str, dict]] = None
    """TransformerEngine userbuffer settings for TP overlap."""

    tp_comm_bootstrap_backend: Optional[str] = None
    """Backend used to bootstrap the userbuffers ('nccl', 'mpi' or 'gloo')."""

    overlap_p2p_comm: Optional[bool] = None
    """Overlap pipeline send/receive with compute (default: on with virtual pipelining)."""

    batch_p2p_comm: Optional[bool] = None
    """Batch pipeline send/receive into one call (default: on with plain pipelining)."""

    overlap_grad_reduce: Optional[bool] = None
    """Overlap the gradient reduce-scatter with the backward pass (default: on when DP > 1 with the
    distributed optimizer)."""

    overlap_param_gather: Optional[bool] = None
    """Overlap the parameter all-gather with the forward pass (default: as overlap_grad_reduce)."""

    overlap_param_gather_with_optimizer_step: Optional[bool] = None
    """Start the first parameter all-gather during the optimizer step."""

    align_param_gather: Optional[bool] = None
    """Launch parameter all-gathers on all pipeline stages together (default: on with virtual
    pipelining and DP overlap)."""

    bucket_size: Optional[int] = field(None, range=INTERVAL)
    """Gradient bucket size in parameters (default: 128 Mi with DP overlap)."""

    defer_embedding_wgrad_compute: Optional[bool] = None
    """Defer the embedding weight-gradient GEMM to overlap it with pipeline flush."""

    wgrad_deferral_limit: Optional[int] = field(None, range=COUNT)
    """How many microbatches of embedding weight gradients to defer."""

    data_parallel_size: Optional[int] = field(init=False, default=None, range=SIZE)
    """Derived: set by runtime_config_update before finalize."""

    def _finalize(self, problems: Problems) -> None:
        if self.data_parallel_size is None:
            problems.add(
                "data_parallel_size",
                "is unknown: comm_overlap is finalized by runtime_config_update",
                "call runtime_config_update(cfg), or set comm_overlap.data_parallel_size before finalize()/setup()",
            )

    # ------------------------------------------------------------------ applying
    def planned(self, model: Any, ddp: Any) -> dict[str, dict[str, Any]]:
        """The values to apply, per target section, derived from the layout and explicit fields."""
        tp = model.tensor_model_parallel_size
        pp = model.pipeline_model_parallel_size
        vp = model.virtual_pipeline_model_parallel_size or 1
        dp = self.data_parallel_size or 1
        dist_opt = ddp.use_distributed_optimizer

        tp_overlap = self.tp_comm_overlap
        if tp_overlap:
            reasons = []
            if tp < 2:
                reasons.append(f"tensor_model_parallel_size={tp} (needs >= 2)")
            if not model.sequence_parallel:
                reasons.append("sequence_parallel is off")
            if model.transformer_impl != "transformer_engine":
                reasons.append(f"TransformerEngine layers are not in use (transformer_impl={model.transformer_impl!r})")
            elif not is_installed("transformer_engine"):
                reasons.append("TransformerEngine layers are not in use (TransformerEngine is not installed)")
            if reasons:
                self._warn_once("comm_overlap: tensor-parallel overlap turned off: " + "; ".join(reasons))
                tp_overlap = False

        if pp > 1 and vp > 1:
            p2p = dict(overlap_p2p_comm=True, batch_p2p_comm=False)
        elif pp > 1:
            p2p = dict(overlap_p2p_comm=False, batch_p2p_comm=True)
        else:
            p2p = dict(overlap_p2p_comm=False, batch_p2p_comm=False)

        dp_overlap = dp > 1 and dist_opt
        model_values = dict(tp_comm_overlap=tp_overlap, **p2p)
        if tp_overlap:
            model_values["tp_comm_overlap_cfg"] = self.tp_comm_overlap_cfg
            model_values["tp_comm_bootstrap_backend"] = self.tp_comm_bootstrap_backend
        model_values["defer_embedding_wgrad_compute"] = self.defer_embedding_wgrad_compute
        model_values["wgrad_deferral_limit"] = self.wgrad_deferral_limit
        ddp_values = dict(
            overlap_grad_reduce=dp_overlap,
            overlap_param_gather=dp_overlap,
            align_param_gather=dp_overlap and pp > 1 and vp > 1,
            bucket_size=DEFAULT_BUCKET_SIZE if dp_overlap else None,
        )
        optimizer_values = dict(overlap_param_gather_with_optimizer_step=self.overlap_param_gather_with_optimizer_step)
        for name in ("overlap_p2p_comm", "batch_p2p_comm"):
            if getattr(self, name) is not None:
                model_values[name] = getattr(self, name)
        for name in ("overlap_grad_reduce", "overlap_param_gather", "align_param_gather", "bucket_size"):
            if getattr(self, name) is not None:
                ddp_values[name] = getattr(self, name)
        # The optimizer holds the same switch; planning it here too (rather than leaving it to the
        # ddp/optimizer sync) keeps a value planned for an earlier layout from outliving it.
        optimizer_values["overlap_param_gather"] = ddp_values["overlap_param_gather"]
        return {
            "model": {k: v for k, v in model_values.items() if v is not None},
            "ddp": ddp_values,
            "optimizer": {k: v for k, v in optimizer_values.items() if v is not None},
        }

    def _warn_once(self, message: str) -> None:
        """Warn about this config once: resolving it again (a dry run, then the run) repeats nothing."""
        said = self.__dict__.setdefault("_warned", set())
        if message not in said:
            said.add(message)
            logger.warning("%s", message)

    def setup(self, model_config: Any, optimizer_config: Any, ddp_config: Any) -> None:
        """Finalize this config and apply it to the three configs (NVIDIA Megatron Bridge's entry
        point; `runtime_config_update` does this). Needs `data_parallel_size` set first;
        raises `ConfigValidationError` listing every problem."""
        problems = Problems()
        finalize_into(self, problems.at("comm_overlap"))
        if not problems:
            self.apply(model_config, ddp_config, optimizer_config, problems)
        problems.raise_if_any()

    def apply(self, model: Any, ddp: Any, optimizer: Any, problems: Problems) -> None:
        """Apply `planned()` values to fields the user did not set explicitly on the targets."""
        targets = {"model": model, "ddp": ddp, "optimizer": optimizer}
        changed = []

        def clash(name: str, current: Any, value: Any) -> Optional[tuple[str, str]]:
            if not self.is_explicit(name):
                return None  # the plan's own default gives way to the user's value
            return f"{current!r} contradicts comm_overlap.{name}={value!r}", f"set {name} in one place only"

        for section, values in self.planned(model, ddp).items():
            target = targets[section]
            values = {k: v for k, v in values.items() if hasattr(target, k)}
            changed += set_unless_user_set(target, values, problems, section, clash)
        if changed:
            logger.info("comm_overlap (dp=%s) set %s", self.data_parallel_size, ", ".join(changed))


# ---------------------------------------------------------------------- TransformerEngine userbuffers
def initialize_tp_communicators(model: Any, micro_batch_size: int) -> bool:
    """Create TransformerEngine's userbuffers when `model.tp_comm_overlap` is on: TE layers built
    with overlap exchange activations through them and fail at their first forward without them.

    They are sized for one micro-batch of activations; `model.tp_comm_overlap_cfg` (a dict, or
    the path of a YAML file) tunes them per GEMM, and TE bootstraps them over
    `model.tp_comm_bootstrap_backend`. Needs the process group. Returns whether they were made.
    """
    if not model.tp_comm_overlap or not model.uses_transformer_engine():
        return False  # megatron-core's local layers do not overlap

    te_base = require("transformer_engine.pytorch.module.base", "comm_overlap.tp_comm_overlap")
    settings = model.tp_comm_overlap_cfg
    if isinstance(settings, str):
        settings = load_file(settings)
    tokens = model.seq_length * micro_batch_size // model.context_parallel_size
    te_base.initialize_ub(
        shape=[tokens, model.hidden_size],
        tp_size=model.tensor_model_parallel_size,
        use_fp8=model.fp8 is not None,
        ub_cfgs=settings or {},
        bootstrap_backend=model.tp_comm_bootstrap_backend,
    )
    return True


def destroy_tp_communicators() -> None:
    """Free the userbuffers (a restarted run in the same process makes new ones)."""
    te_base = require("transformer_engine.pytorch.module.base", "comm_overlap.tp_comm_overlap")
    destroy = getattr(te_base, "destroy_ub", None)  # older TE releases cannot free them
    if destroy is not None:
        destroy()
