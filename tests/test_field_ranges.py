"""Every numeric config field has a declared range, and validation agrees with it: values sampled
inside the range pass the section's validation, values outside it are refused naming the field."""

from __future__ import annotations

import copy
import dataclasses
import math
import re

import pytest

from megatron_bridge.config import megatron_core_fields
from megatron_bridge.config.base import ConfigBase, finalize_into
from megatron_bridge.config.errors import Problems
from megatron_bridge.config.field_catalog import config_classes, declared_specs
from megatron_bridge.config.fields import Unsupported
from megatron_bridge.config.schema import specs, undeclared_ranges

RELATED = {
    "GPTModelProvider.hidden_size": "num_attention_heads",
    "GPTModelProvider.window_attn_skip_freq": "num_layers",
    "CheckpointConfig.ckpt_step": "load",
    "CheckpointConfig.save_interval": "save",
    "CheckpointConfig.most_recent_k": "save",
    "TrainingConfig.manual_gc_interval": "manual_gc",
    "SchedulerConfig.lr_wsd_decay_iters": "lr_decay_style",
    "SchedulerConfig.lr_wsd_decay_samples": "lr_decay_style",
    "ProfilingConfig.profile_step_start": "use_pytorch_profiler",
    "ProfilingConfig.profile_step_end": "use_pytorch_profiler",
    "ProfilingConfig.profile_ranks": "use_pytorch_profiler",
    "TrainingConfig.rampup_batch_size": "global_batch_size",
    "OptimizerConfig.min_lr": "lr",
    "GPTModelProvider.expert_model_parallel_size": "num_moe_experts",
    "GPTModelProvider.local_rotary_base": "window_size",
    "GPTModelProvider.rope_scaling_factor": "rope_scaling",
    "GPTModelProvider.mtp_loss_scaling_factor": "mtp_num_layers",
    "GPTModelProvider.moe_ffn_hidden_size": "num_moe_experts",
    "GPTModelProvider.moe_shared_expert_intermediate_size": "num_moe_experts",
    "GPTModelProvider.num_query_groups": "num_attention_heads",
    **{f"OptimizerConfig.{n}": "fp16" for n in (
        "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")},
    "GPTModelProvider.moe_router_bias_update_rate": "moe_router_enable_expert_bias",
    "GPTModelProvider.mrope_section": "position_embedding_type",
    "GPTModelProvider.cpu_offloading_num_layers": "cpu_offloading",
    **{f"GPTModelProvider.{n}": "position_embedding_type" for n in (
        "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
        "yarn_mscale", "yarn_mscale_all_dim")},
}  # fmt: skip
"""Fields whose in-range values another field limits further; validation may refuse such a value
only with a message that names that field."""

SHAPES = {"window_size": lambda v: (v, 0), "rampup_batch_size": lambda v: [v, v, v]}
"""Lists whose items relate to each other: the sampled number in a valid shape."""


def _sections() -> dict[type, ConfigBase]:
    """One instance of each config class: the sections of a valid tiny config, else the defaults."""
    from tests.factories import tiny_config
    from megatron_bridge.peft.config import LoRA

    found: dict[type, ConfigBase] = {}

    def walk(obj):
        if isinstance(obj, ConfigBase) and type(obj) not in found:
            found[type(obj)] = obj
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name, None))

    walk(tiny_config(peft=LoRA()))
    for cls in config_classes():
        if cls not in found:
            try:
                found[cls] = cls()
            except (TypeError, ValueError):  # needs arguments: another section has its fields
                pass
    return found


def _inside(spec) -> list:
    r, whole = spec.range, spec.numeric is int
    low = r.low if r.low is not None else -1e6
    high = r.high if r.high is not None else 1e6
    if not r.low_inclusive or r.low is None:
        low = low + 1 if whole else math.nextafter(low, math.inf)
    if not r.high_inclusive or r.high is None:
        high = high - 1 if whole else math.nextafter(high, -math.inf)
    middle = (low + high) // 2 if whole else (low + high) / 2
    values = {low, high, middle, min(low + 1, high)} if whole else {low, high, middle}
    return sorted((int(v) if whole else float(v)) for v in values) + list(r.also)


def _outside(spec) -> list:
    r, whole = spec.range, spec.numeric is int
    values = []
    if r.low is not None:
        values.append(r.low - 1 if r.low_inclusive and whole else r.low - max(1.0, abs(r.low)) if r.low_inclusive else r.low)
    if r.high is not None:
        values.append(r.high + 1 if r.high_inclusive and whole else 2 * r.high + 1 if r.high_inclusive else r.high)
    if not whole:
        values += [math.nan, math.inf, -math.inf]
    return [v for v in values if v not in r.also]


def _problems_of(section: ConfigBase, name: str, number) -> tuple[object, list]:
    obj = copy.deepcopy(section)
    current = getattr(obj, name, None)
    text = str(specs(type(obj))[name].type).lower()
    if name in SHAPES:
        value = SHAPES[name](number)
    elif isinstance(current, (list, tuple)) or (current is None and ("list" in text or "tuple" in text)):
        value = type(current or [])([number] * max(1, len(current or ())))
    else:
        value = number
    obj.__dict__[name] = value  # as a file or an override sets it, before the section's validation
    problems = Problems()
    finalize_into(obj, problems)
    return value, [p for p in problems.items if re.match(rf"{re.escape(name)}($|[.\[])", p.path)]


def _numeric_fields():
    sections = _sections()
    for (owner, name), spec in declared_specs().items():
        if spec.numeric is None or not spec.init or isinstance(spec.status, Unsupported):
            continue  # derived fields are not set by users; unsupported ones refuse any change
        holder = sections.get(spec.cls) or next(o for c, o in sections.items() if name in specs(c) and
                                                 issubclass(c, spec.owner))  # fmt: skip
        yield f"{owner}.{name}", spec, holder


def test_every_numeric_field_declares_its_range():
    undeclared = sorted({n for cls in config_classes() for n in undeclared_ranges(cls)})
    assert undeclared == []
    for key in megatron_core_fields.RANGES:  # no stale entries in the megatron-core table
        cls_name, name = key.split(".")
        owners = [c for cls in config_classes() for c in cls.__mro__ if c.__name__ == cls_name and
                  name in c.__dict__.get("__dataclass_fields__", {}) and c.__module__.startswith("megatron.")]  # fmt: skip
        assert owners, f"{key} is not a field of megatron-core's {cls_name}"


def test_validation_agrees_with_every_declared_range():
    checked, disagreements = 0, []
    for key, spec, section in _numeric_fields():
        checked += 1
        for number in _inside(spec):
            value, found = _problems_of(section, spec.name, number)
            related = RELATED.get(key)
            refused = [p for p in found if not (related and re.search(rf"\b{related}\b", p.message))]
            if refused:
                disagreements.append(f"{key}={value!r} is inside {spec.range} but refused: {refused[0]}")
        for number in _outside(spec):
            value, found = _problems_of(section, spec.name, number)
            if not found:
                disagreements.append(f"{key}={value!r} is outside {spec.range} but accepted")
    assert checked > 200  # every section's numbers, megatron-core's included
    assert disagreements == []


@pytest.mark.parametrize(
    "section, name, value, message",
    [
        ("checkpoint", "most_recent_k", 0, "checkpoint.most_recent_k: must be -1 (keep all) or >= 1, got 0 (use a value in -1 or [1, 2**31))"),
        ("optimizer", "lr", -1e-4, "optimizer.lr: -0.0001 is outside the allowed range [0, 10] (choose a value in that range)"),
        ("tokenizer", "vocab_size", 1, "tokenizer.vocab_size: 1 is outside the allowed range [2, 2**31) (choose a value in that range)"),
    ],
)  # fmt: skip
def test_refusals_name_the_field_and_its_range(section, name, value, message):
    from megatron_bridge.config.errors import ConfigValidationError
    from megatron_bridge.training.config import runtime_config_update
    from tests.factories import tiny_config

    cfg = tiny_config()
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigValidationError) as info:
        runtime_config_update(cfg)
    assert message in str(info.value)


def test_a_learning_rate_of_zero_is_accepted():
    """0 is inside lr's range [0, 10]: the run computes gradients and changes nothing."""
    from megatron_bridge.training.config import runtime_config_update
    from tests.factories import tiny_config

    cfg = tiny_config()
    cfg.optimizer.lr, cfg.optimizer.min_lr = 0.0, 0.0
    runtime_config_update(cfg)
    assert cfg.optimizer.lr == 0.0


@pytest.mark.timeout(120)
def test_help_config_shows_range_and_status():
    import subprocess
    import sys

    from tests.factories import REPO, source_tree_env

    argv = [sys.executable, "-m", "megatron_bridge", "pretrain", "--recipe", "tiny_gpt_pretrain_config",
            "--help-config", "checkpoint"]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, env=source_tree_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    checkpoint = proc.stdout
    assert "\n      status: unsupported: only torch_dist checkpoints are written" in checkpoint
    assert re.search(r"\n  most_recent_k: .*\n      range -1 or \[1, 2\*\*31\); status: used\n", checkpoint)
    assert re.search(r"\n  save: Optional\[str\] = .*\n      status: used\n", checkpoint)
