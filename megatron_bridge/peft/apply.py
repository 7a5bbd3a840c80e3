"""Putting adapters into a built model: checking the targets, wrapping, freezing the base.

`check_config` runs with the config validation (before anything is built); `apply_peft` runs on
each model chunk right after megatron-core builds it and before it is wrapped for data
parallelism, so DDP and the optimizer only ever see the adapter parameters as trainable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from megatron_bridge.config.errors import ConfigProblem, ConfigValidationError, Problems
from megatron_bridge.peft import targets as tg
from megatron_bridge.runtime.checkpointing.run_config import find_run_config
from megatron_bridge.runtime.checkpointing.weights import is_adapter_key
from megatron_bridge.peft.config import DoRA
from megatron_bridge.peft.modules import AdaptedLinear
from megatron_bridge import extras

if TYPE_CHECKING:
    from megatron_bridge.peft.config import LoRA
    from megatron_bridge.training.config import ConfigContainer

logger = logging.getLogger("megatron_bridge")


# ---------------------------------------------------------------------- before building
def check_config(cfg: "ConfigContainer", problems: Problems) -> None:
    """Adapters: target modules exist, fine-tuning starts from a checkpoint, the layout supports them."""
    peft, m = cfg.peft, cfg.model
    if peft is None:
        return
    method = peft.method_name
    problems.check(
        cfg.checkpoint.pretrained_checkpoint is not None,
        "checkpoint.pretrained_checkpoint",
        f"{method} trains adapters on top of pretrained weights, and none are given",
        "set checkpoint.pretrained_checkpoint to the checkpoint of the base model",
    )
    _check_saved_runs(cfg, method, problems)
    if problems.at("peft") or m.num_layers is None or m.num_layers <= 0:
        return
    if m.transformer_layer_spec is not None:
        return  # a custom layer spec: the names are known once it is built (checked then)
    names = tg.expected_names(m)
    selected, unmatched = tg.match_targets(peft.target_modules, names)
    for target in unmatched:
        i = peft.target_modules.index(target)
        problems.add(
            f"peft.target_modules.{i}",
            f"{target!r} matches no module of this model ({tg.describe_valid(names)})",
            "use one of the valid names or a pattern that matches some",
        )
    experts = [n for n in selected if tg.is_expert_name(n)]
    if experts:
        _check_expert_targets(cfg, experts, method, problems)
    if m.transformer_impl == "transformer_engine" and _te_installed():
        problems.add(
            "model.transformer_impl",
            f"{method} wraps megatron-core's local linear layers; TransformerEngine's fused layers cannot be wrapped",
            "set model.transformer_impl='local'",
        )


def saved_with_peft(path: Any) -> Optional[bool]:
    """Whether the checkpoint at `path` was saved by a PEFT run (None: no readable checkpoint)."""
    try:
        saved = find_run_config(path)
    except (OSError, ValueError):  # ValueError: a broken tracker or run config (reported when loaded)
        return None
    return None if saved is None else saved.with_peft


def _check_saved_runs(cfg: "ConfigContainer", method: str, problems: Problems) -> None:
    """The base must be full weights, and a checkpoint to resume from must be this kind of run."""
    c = cfg.checkpoint
    if c.pretrained_checkpoint is not None and saved_with_peft(c.pretrained_checkpoint):
        problems.add(
            "checkpoint.pretrained_checkpoint",
            f"{c.pretrained_checkpoint!r} holds the adapters of a PEFT run, not base weights",
            "point it at the base model's checkpoint, or fold the adapters in first (mbridge peft merge)",
        )
    if c.load is not None and saved_with_peft(c.load) is False:
        problems.add(
            "checkpoint.load",
            f"{c.load!r} holds a checkpoint without adapters; a {method} run resumes only from its own adapter checkpoints",
            "set checkpoint.load to this run's save directory (or a new one); the base goes in pretrained_checkpoint",
        )
    if c.load is not None:
        _check_resumed_adapters(cfg, problems)


def _check_resumed_adapters(cfg: "ConfigContainer", problems: Problems) -> None:
    """Adapters resumed from `checkpoint.load` must be the ones this config builds: the same method,
    rank and adapted modules (a different rank cannot load; fewer targets would drop trained
    adapters, more would start some from scratch)."""
    c, peft = cfg.checkpoint, cfg.peft
    try:
        saved = find_run_config(c.load, c.ckpt_step)
    except (OSError, ValueError):  # reported when loaded
        return
    if saved is None or not saved.with_peft:
        return
    before = saved.section("peft")
    where = f"the adapters in {c.load!r} (iteration directory {os.path.basename(saved.directory)})"
    fix = "train new adapters in another run directory (--name NEW, or checkpoint.save and checkpoint.load elsewhere)"
    kind = str(before.get("_target_", "")).rsplit(".", 1)[-1]
    if kind in ("LoRA", "DoRA") and kind != peft.method_name:
        problems.add("peft", f"{peft.method_name}, but {where} are {kind}", f"set peft={kind.lower()} to resume them, or {fix}")
        return
    if before.get("dim") is not None and before["dim"] != peft.dim:
        problems.add("peft.dim", f"{peft.dim}, but {where} have rank {before['dim']}", f"set peft.dim={before['dim']} to resume them, or {fix}")
    targets = before.get("target_modules")
    if not isinstance(targets, list) or list(targets) == list(peft.target_modules):
        return
    m = cfg.model
    if m.transformer_layer_spec is None and m.num_layers:
        names = tg.expected_names(m)
        if tg.match_targets(targets, names)[0] == tg.match_targets(peft.target_modules, names)[0]:
            return  # other patterns, the same modules
    problems.add(
        "peft.target_modules",
        f"{list(peft.target_modules)}, but {where} were trained on {targets}",
        f"set peft.target_modules={_flow_list(targets)} to resume them, or {fix}",
    )


def _flow_list(items: list) -> str:
    """A list as an override value: [a,b]."""
    return "[" + ",".join(str(i) for i in items) + "]"


def _check_expert_targets(cfg: "ConfigContainer", experts: list[str], method: str, problems: Problems) -> None:
    m = cfg.model
    if m.moe_grouped_gemm:
        problems.add(
            "peft.target_modules",
            f"{method} cannot wrap grouped-GEMM experts ({experts[0]}, ...): their weights are one fused tensor per "
            "layer, not linear layers",
            "set model.moe_grouped_gemm=False (experts as separate linear layers), or leave the experts out of "
            "target_modules (e.g. '*.self_attention.*' patterns)",
        )
    etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
    if etp > 1:
        problems.add(
            "peft.target_modules",
            f"adapters on MoE experts need expert_tensor_parallel_size=1, got {etp} ({experts[0]}, ...)",
            "set model.expert_tensor_parallel_size=1 (experts are then split by expert parallelism only), or leave "
            "the experts out of target_modules",
        )


def _te_installed() -> bool:
    return extras.is_installed("transformer_engine")


# ---------------------------------------------------------------------- building
@dataclass
class Applied:
    """What `apply_peft` did to one model chunk."""

    wrapped: list[str]
    """Global names of the adapted modules."""

    matched: list[bool]
    """Per target of the config: whether it selected a module in this chunk."""

    candidates: list[str]
    """Global names of every adaptable module in this chunk."""


def apply_peft(chunk: Any, peft: "LoRA", seed: int = 0) -> Applied:
    """Freeze every parameter of `chunk`, then replace each targeted linear layer by an
    `AdaptedLinear` whose adapter parameters are the only trainable ones. Each adapter is
    initialized from a generator seeded with `seed` and its module's global name, so every
    parallel layout (TP, PP, EP) starts from the same adapters."""
    import zlib

    import torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    found = tg.adaptable_modules(chunk)
    names = [g for g, *_ in found]
    matched = [any(tg.matches(t, n) for n in names) for t in peft.target_modules]
    for param in chunk.parameters():
        param.requires_grad = False
    wrapped, problems = [], Problems()
    for global_name, local, module, parent in found:
        if not any(tg.matches(t, global_name) for t in peft.target_modules) or isinstance(module, AdaptedLinear):
            continue
        if isinstance(module, ColumnParallelLinear):
            kind = "column"
        elif isinstance(module, RowParallelLinear):
            kind = "row"
        else:
            problems.add(
                "peft.target_modules",
                f"{global_name} is a {type(module).__name__}, which {peft.method_name} cannot wrap (adapters wrap "
                "megatron-core's ColumnParallelLinear and RowParallelLinear)",
                "build with model.transformer_impl='local', or leave this module out of target_modules",
            )
            continue
        if kind == "column" and getattr(module, "gather_output", False):
            problems.add(
                "peft.target_modules",
                f"{global_name} gathers its output over TP, which adapters do not support",
                "leave it out of target_modules",
            )
            continue
        if getattr(module, "explicit_expert_comm", False) and module.tp_group.size() > 1:
            problems.add(
                "peft.target_modules",
                f"{global_name} is an expert split over {module.tp_group.size()} expert-tensor-parallel ranks; adapters on experts need expert_tensor_parallel_size=1",
                "set model.expert_tensor_parallel_size=1, or leave the experts out of target_modules",
            )
            continue
        leaf = local.rsplit(".", 1)[-1]
        glu = leaf == "linear_fc1" and bool(getattr(getattr(parent, "config", None), "gated_linear_unit", False))
        adapted = AdaptedLinear(
            module, kind, peft.dim, peft.scale, peft.dropout, peft.dropout_position, isinstance(peft, DoRA), glu
        )
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
        adapted.init_adapter(peft.lora_A_init_method, peft.lora_B_init_method, generator)
        setattr(parent, leaf, adapted)
        wrapped.append(global_name)
    problems.raise_if_any()
    return Applied(wrapped=wrapped, matched=matched, candidates=names)


def check_all_targets_matched(peft: "LoRA", applied: list[Applied]) -> None:
    """Every target must select a module somewhere in the model (over all pipeline stages);
    raises a `ConfigValidationError` naming the valid names otherwise."""
    import torch
    from megatron.core import parallel_state

    counts = torch.tensor(
        [sum(a.matched[i] for a in applied) for i in range(len(peft.target_modules))], dtype=torch.int64
    )
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        device = "cuda" if torch.cuda.is_available() and torch.distributed.get_backend(group) == "nccl" else "cpu"
        counts = counts.to(device)
        torch.distributed.all_reduce(counts, group=group)
    names = [n for a in applied for n in a.candidates]
    problems = [
        ConfigProblem(
            f"peft.target_modules.{i}",
            f"{t!r} matches no module of this model ({tg.describe_valid(names) if names else 'it has no adaptable layers'})",
            "use one of the valid names or a pattern that matches some",
        )
        for i, t in enumerate(peft.target_modules)
        if counts[i].item() == 0
    ]
    if problems:
        raise ConfigValidationError(problems)


# ---------------------------------------------------------------------- using an adapted model
def adapters(model: Any) -> Iterator[Any]:
    """Every `AdaptedLinear` in `model` (a chunk, a wrapped chunk, or a list of chunks)."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for module in chunk.modules():
            if isinstance(module, AdaptedLinear):
                yield module


def has_adapters(model: Any) -> bool:
    return next(adapters(model), None) is not None


def trainable_counts(model: Any) -> tuple[int, int]:
    """(trainable, total) parameters of this rank's part of `model`."""
    seen, trainable, total = set(), 0, 0
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for p in chunk.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            trainable += p.numel() if p.requires_grad else 0
    return trainable, total


def base_weights_loaded(model: Any) -> None:
    """After the base weights were (re)loaded: DoRA magnitudes start as the loaded weights' row
    norms, so the adapted model starts as its base."""
    for adapter in adapters(model):
        if adapter.dora:
            adapter.reset_magnitude()


def merge_and_unwrap(model: Any) -> int:
    """Fold every adapter into its base weight and put the plain layer back; returns how many."""
    count = 0
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for name, module in list(chunk.named_modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, AdaptedLinear):
                    child.merge()
                    setattr(module, child_name, child.base_layer)
                    count += 1
    return count
