"""`--dry-run`: resolve a config as a real run at a given world size would, without a process
group, and print it with the sizes it implies.

A dry run resolves for the GPUs it plans for, not for this machine: TransformerEngine is taken
as installed there (GPU recipes use its layers; a login node rarely has it), so what depends on it
(tensor-parallel communication overlap, the layers the plan counts) is what the run will get.
`--no-te` resolves for GPUs without it (megatron-core's local layers). The output says which.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

from megatron_bridge.cli.errors import UsageError, config_errors_are_usage_errors
from megatron_bridge import extras
from megatron_bridge.config import status
from megatron_bridge.config.errors import ConfigValidationError, Problems
from megatron_bridge.extras import installed_here

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer


def resolve(cfg: "ConfigContainer", world_size: int, finetuning: bool = False, target_te: bool = True) -> None:
    """`runtime_config_update` at `world_size`. Unlike a real CPU run, the model is not adapted
    for CPU: the config is checked as written, for the machines it targets, which have
    TransformerEngine if `target_te`. With `finetuning`, what `finetune()` requires is reported
    with the config's problems, in one report."""
    # the expert rule as the GPU run takes it (runtime_config_update takes it on CUDA only)
    from megatron_bridge.training.config.runtime import adapt_expert_mlp, runtime_config_update

    problem_prefix = f"the config does not resolve at world size {world_size}: "
    with config_errors_are_usage_errors(problem_prefix), for_target(target_te):
        problems = Problems()
        # what a GPU run decides for grouped-GEMM experts, where its rule runs (before validation;
        # a rule taken on CUDA only): a default gives way to sequential experts, with its note, so
        # the checks that follow (LoRA on experts) see them; a refusal is a `machine_problems` line
        adapt_expert_mlp(cfg, Problems())
        try:
            runtime_config_update(cfg, world_size=world_size)
        except ConfigValidationError as err:
            problems.absorb(err)
        if finetuning:
            from megatron_bridge.training.finetune import check_pretrained_weights

            check_pretrained_weights(cfg, problems)
        problems.raise_if_any()


class _Notes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        kind = "note" if record.levelno < logging.WARNING else record.levelname.lower()
        self.lines.extend(f"{kind}: {line}" for line in record.getMessage().splitlines())


@contextlib.contextmanager
def noted_decisions() -> Iterator[list[str]]:
    """What the project logs while the block builds and resolves a config (INFO and up): what a
    recipe, a preset or a rule decided for the user, which a dry run shows as comments."""
    logger = logging.getLogger("megatron_bridge")
    notes, level = _Notes(), logger.level
    logger.addHandler(notes)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    try:
        yield notes.lines
    finally:
        logger.removeHandler(notes)
        logger.setLevel(level)


def for_target(target_te: bool) -> Any:
    """The context in which a config is resolved and planned for GPUs that have TransformerEngine
    (`target_te`) or not, whatever this machine has."""
    return extras.assume_installed(transformer_engine=target_te)


def layers_note(cfg: "ConfigContainer", options: "PlanOptions") -> str:
    """Which layers the config was resolved for, and why: one line for the output."""
    note = _layers(cfg, options)
    if getattr(cfg.model, "num_moe_experts", None) and not cfg.model.moe_grouped_gemm:
        note += "; the experts run one GEMM each (SequentialMLP: model.moe_grouped_gemm=False)"
    return note


def _layers(cfg: "ConfigContainer", options: "PlanOptions") -> str:
    from megatron_bridge.planning.devices import GPUS

    impl = cfg.model.transformer_impl
    if impl != "transformer_engine":
        return f"megatron-core local layers (model.transformer_impl={impl!r})"
    if not options.target_te:
        return "megatron-core local layers (--no-te: TransformerEngine taken as not installed on the GPUs)"
    gpus = GPUS[options.gpu].name if options.gpu in GPUS else options.gpu
    if installed_here("transformer_engine"):
        return f"TransformerEngine layers on the {gpus} GPUs (installed on this machine too)"
    return (
        f"TransformerEngine layers on the {gpus} GPUs, where it is assumed installed (this machine "
        "has none); --no-te resolves for megatron-core's local layers"
    )


def human(n: float) -> str:
    """1234567 -> '1.23M'; 999885952 -> '1B' (the unit is chosen after rounding to three digits,
    so a count just under a unit does not print as '1e+03M')."""
    rounded = abs(float(f"{n:.3g}"))
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if rounded >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def summary(cfg: "ConfigContainer", world_size: int) -> list[tuple[str, str]]:
    """(label, text) pairs of the values a resolved `cfg` derives for `world_size` ranks."""
    from megatron_bridge.models import count_parameters

    m, t, s = cfg.model, cfg.train, cfg.scheduler
    dp = cfg.data_parallel_size
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    gbs, mbs = t.global_batch_size, t.micro_batch_size
    rows = [("data-parallel size", f"{dp}  (world {world_size} / (TP {tp} x PP {pp} x CP {cp}))")]
    if gbs and mbs and dp:
        rows.append(("microbatches per step", f"{gbs // (mbs * dp)}  (GBS {gbs} / (MBS {mbs} x DP {dp}))"))
    rows.append(("train iterations", str(t.train_iters)))
    rows.append(
        ("scheduler steps", f"lr_warmup_steps={s.lr_warmup_steps}, lr_decay_steps={s.lr_decay_steps}  (in samples)")
    )
    count = count_parameters(m)
    params = f"{count.total:,} ({human(count.total)})"
    if count.active != count.total:
        params += f", active per token {count.active:,} ({human(count.active)})"
    rows.append(("parameters", params))
    if gbs:
        tokens = f"{gbs * m.seq_length:,}  (GBS {gbs} x seq_length {m.seq_length})"
        padded = getattr(cfg.dataset, "packed_sequence_specs", False) is None and m.pipeline_model_parallel_size == 1
        if padded:  # fine-tuning batches, unpacked, are padded to their longest sample
            tokens = f"at most {tokens}; each batch is padded to its longest sample"
        rows.append(("tokens per step", tokens))
    return rows


@dataclass
class PlanOptions:
    """What the plan is computed for (`--gpu`, `--mfu`) and how it is printed (`--json`)."""

    gpu: str = "h100-80gb"
    mfu: Optional[float] = None
    as_json: bool = False
    target_te: bool = True
    """Resolve and plan for GPUs with TransformerEngine (False: `--no-te`)."""


def make_plan(cfg: "ConfigContainer", label: str, options: PlanOptions) -> Any:
    """The planner's plan of a resolved `cfg`, or None when it uses a feature the planner does
    not model (a line on stderr says which)."""
    import sys

    from megatron_bridge.planning import DEFAULT_MFU, PlanningError, plan

    try:
        with for_target(options.target_te):
            return plan(cfg, gpu=options.gpu, mfu=options.mfu or DEFAULT_MFU, label=label)
    except PlanningError as exc:
        print(f"mbridge: no plan: {exc}", file=sys.stderr)
        return None


def print_dry_run(cfg: "ConfigContainer", world_size: int, world_source: str, label: str,
                  options: Optional[PlanOptions] = None, finetuning: bool = False, notes: Sequence[str] = ()) -> None:
    """Resolve `cfg` at `world_size`, print its YAML, then the summary, what was decided for the
    user (`notes`, and what resolving logs) and the plan as YAML comments (so the output is still
    a loadable config)."""
    options = options or PlanOptions()
    with noted_decisions() as resolving:
        resolve(cfg, world_size, finetuning, options.target_te)
    print(cfg.to_yaml(), end="")
    print(f"# ---- dry run of {label} at world size {world_size} ({world_source}) ----")
    rows = [("resolved for", layers_note(cfg, options))] + summary(cfg, world_size)
    width = max(len(k) for k, _ in rows) + 1
    for key, text in rows:
        print(f"# {key + ':':<{width}} {text}")
    for line in [*notes, *resolving]:
        print(f"# {line}")
    for line in machine_problems(cfg):
        print(f"# would fail on this machine: {line}")
    result = make_plan(cfg, label, options)
    if result is not None:
        print("# ---- " + "\n# ".join(result.text()))
    check_data_on_this_machine(cfg, width)  # last: unusable data ends the dry run with an error


def machine_problems(cfg: "ConfigContainer") -> list[str]:
    """What a run of `cfg` would trip over on this machine (not in the config itself): output
    directories that cannot be written, too little space for a checkpoint, settings that need a
    GPU, TransformerEngine or a grouped GEMM, context parallelism on local layers."""
    from megatron_bridge.models.attention import layer_problems
    from megatron_bridge.models.experts import GROUPED_GEMM_FIX, machine_decision
    from megatron_bridge.training import preflight

    found = [str(p) for p in preflight.check_outputs(cfg, create=False)] + status.machine_problems(cfg)
    found += [str(p) for p in layer_problems(cfg.model)]
    experts = machine_decision(cfg.model)
    if experts.refused:
        found.append(f"model.moe_grouped_gemm: {experts.message} ({GROUPED_GEMM_FIX})")
    warning = preflight.free_space_warning(cfg)
    return found + ([warning] if warning else [])


def print_plan(cfg: "ConfigContainer", world_size: int, world_source: str, label: str, options: PlanOptions,
               finetuning: bool = False) -> None:
    """`--plan-only`: resolve `cfg` at `world_size` and print only its plan (text or JSON)."""
    resolve(cfg, world_size, finetuning, options.target_te)
    result = make_plan(cfg, label, options)
    if result is None:
        raise UsageError(f"{label}: the planner cannot plan this config (see above)")
    if options.as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print("\n".join(result.text()))
        print(f"(world size {world_size}: {world_source}; resolved for {layers_note(cfg, options)})")


def check_data_on_this_machine(cfg: "ConfigContainer", width: int) -> None:
    """The data checks of a real run, as comments; data absent from this machine (a login
    node) is noted, not an error. Data present but unusable is an error."""
    from megatron_bridge.data.checks import dry_run_lines

    lines, error = dry_run_lines(cfg)
    for i, line in enumerate(lines):
        print(f"# {('data:' if i == 0 else ''):<{width}} {line}")
    if error is not None:
        raise UsageError(f"the data has problems: {error}")


def default_world_size(recipe_world_size: Optional[int]) -> tuple[int, str]:
    """The world size to check at, and where it came from: WORLD_SIZE (a launcher's, so the
    real one), else the recipe's intended one (also when recorded in a config file), else 1."""
    text = os.environ.get("WORLD_SIZE")
    if text is not None:
        if not text.isdigit() or int(text) < 1:
            raise UsageError(f"WORLD_SIZE={text!r} is not a positive integer (or pass --world-size N)")
        return int(text), "WORLD_SIZE"
    if recipe_world_size is not None:
        return recipe_world_size, "the recipe's world size"
    return 1, "default"
