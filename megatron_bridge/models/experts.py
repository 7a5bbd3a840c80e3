"""Which expert MLP the MoE layers of a GPU run use: one grouped GEMM over the local experts, or
one GEMM per expert (megatron-core's `SequentialMLP`).

`moe_grouped_gemm=True` needs a grouped GEMM: TransformerEngine's grouped linear layers (in TE
layers, unless `moe_use_legacy_grouped_gemm`), or else the `grouped_gemm` package (megatron-core's
legacy `GroupedMLP`). Without either, megatron-core stops with an assertion while it builds the
model. This is decided when the config is resolved for a GPU run instead: a grouped GEMM that
comes from a default (a recipe or model class) gives way to sequential experts with a log line;
one the user asked for is refused with the fix. CPU runs use sequential experts already (the CPU
adaptation).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Optional

from megatron_bridge.config.errors import Problems
from megatron_bridge.models.attention import te_layers

if TYPE_CHECKING:
    from megatron_bridge.training.config.container import ConfigContainer

logger = logging.getLogger(__name__)

GROUPED_GEMM_FIX = (
    "install the grouped_gemm package (pip install git+https://github.com/fanshiqing/grouped_gemm@v1.1.4) "
    "or TransformerEngine, or set model.moe_grouped_gemm=False (sequential experts)"
)


@dataclasses.dataclass(frozen=True)
class ExpertMLPDecision:
    """What `moe_grouped_gemm` becomes for a run, and what to say about it."""

    grouped_gemm: bool
    """The value the model is built with."""

    message: Optional[str] = None
    """The log line (a default given way) or the problem (an explicit ask refused)."""

    refused: bool = False
    """True if the config cannot be built as the user set it."""


def grouped_gemm_source(te_layers: bool, legacy: bool, grouped_gemm_installed: bool) -> Optional[str]:
    """Where the grouped GEMM of the expert layers comes from, or None where there is none."""
    if te_layers and not legacy:
        return "TransformerEngine's grouped linear layers"
    if grouped_gemm_installed:
        return "the grouped_gemm package"
    return None


def decide_grouped_gemm(model: Any, *, te_layers: bool, grouped_gemm_installed: bool) -> ExpertMLPDecision:
    """The expert MLP of `model` on a GPU with (or without) TransformerEngine layers and the
    grouped_gemm package. Pure: the caller says what the machine has."""
    if not model.num_moe_experts or not model.moe_grouped_gemm:
        return ExpertMLPDecision(bool(model.moe_grouped_gemm))
    legacy = bool(model.moe_use_legacy_grouped_gemm)
    source = grouped_gemm_source(te_layers, legacy, grouped_gemm_installed)
    if source is not None and not (model.add_bias_linear and source == "the grouped_gemm package"):
        return ExpertMLPDecision(True)
    if source is not None:  # megatron-core's legacy GroupedMLP has no expert biases
        missing = "megatron-core's grouped GEMM without TransformerEngine (GroupedMLP) has no expert biases"
    else:
        missing = "the grouped_gemm package is not installed" + (
            "" if te_layers else " and the layers are not TransformerEngine's"
        )
    explicit = getattr(model, "is_explicit", None)
    if explicit is not None and explicit("moe_grouped_gemm"):
        return ExpertMLPDecision(True, f"moe_grouped_gemm=True needs a grouped GEMM, but {missing}", refused=True)
    return ExpertMLPDecision(False, f"model.moe_grouped_gemm=False: {missing}; the experts run one GEMM each (SequentialMLP)")


def grouped_gemm_installed() -> bool:
    """megatron-core's own test: `grouped_gemm` imports."""
    from megatron.core.transformer.moe import grouped_gemm_util

    return grouped_gemm_util.grouped_gemm_is_available()


def machine_decision(model: Any) -> ExpertMLPDecision:
    """`decide_grouped_gemm` for this machine."""
    if not model.num_moe_experts or not model.moe_grouped_gemm:
        return ExpertMLPDecision(bool(model.moe_grouped_gemm))
    return decide_grouped_gemm(model, te_layers=te_layers(model), grouped_gemm_installed=grouped_gemm_installed())


def adapt_expert_mlp(cfg: "ConfigContainer", problems: Problems) -> None:
    """Grouped-GEMM experts on a GPU without a grouped GEMM: a default gives way to sequential
    experts (logged), an explicit `model.moe_grouped_gemm=True` is refused with the fix."""
    decision = machine_decision(cfg.model)
    if decision.refused:
        problems.add("model.moe_grouped_gemm", decision.message, GROUPED_GEMM_FIX)
    elif decision.message is not None:
        cfg.model.apply_default("moe_grouped_gemm", decision.grouped_gemm)
        logger.info(decision.message)
