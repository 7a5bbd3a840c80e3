"""The range of every numeric config field, and the check that a value lies in it.

A numeric field takes its range from, in order: `FIELD_RANGES` (by `Class.field`, then by field
name), the naming rules in `NAME_RULES`, then its type: floats must be finite, ints must be
non-negative and below 2**63. A value outside its range is a configuration problem that names the
range. Lists of numbers (e.g. `moe_aux_loss_coeff` per layer) are checked item by item.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Optional

from megatron_bridge.config.annotations import field_types, real_arms
from megatron_bridge.config.errors import Problems, show


@dataclass(frozen=True)
class Range:
    """Numbers from `low` to `high` (each inclusive or not); `None` is unbounded. NaN and
    infinities are never in a range."""

    low: Optional[float]
    high: Optional[float]
    low_inclusive: bool = True
    high_inclusive: bool = False

    def __str__(self) -> str:
        lo = "-inf" if self.low is None else _num(self.low)
        hi = "inf" if self.high is None else _num(self.high)
        opening = "[" if self.low_inclusive and self.low is not None else "("
        closing = "]" if self.high_inclusive and self.high is not None else ")"
        return f"{opening}{lo}, {hi}{closing}"

    def problem(self, value: Any) -> Optional[str]:
        """Why `value` is outside this range, or None."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None  # the type check reports non-numbers
        if isinstance(value, float) and not math.isfinite(value):
            return f"{value!r} is not a finite number (the allowed range is {self})"
        below = self.low is not None and (value < self.low or (value == self.low and not self.low_inclusive))
        above = self.high is not None and (value > self.high or (value == self.high and not self.high_inclusive))
        if below or above:
            return f"{show(value)} is outside the allowed range {self}"
        return None


def _num(x: float) -> str:
    for power in (63, 31, 32, 64):
        if x == 2**power:
            return f"2**{power}"
    return str(int(x)) if float(x).is_integer() else repr(x)


def parse(spec: str) -> Range:
    """`"[0, 1]"`, `"(0, inf)"`, `"[1, 2**31)"`, ... as a Range."""
    m = re.fullmatch(r"\s*([\[(])\s*([^,]+?)\s*,\s*([^,]+?)\s*([\])])\s*", spec)
    if not m:
        raise ValueError(f"bad range {spec!r}")

    def bound(text: str) -> Optional[float]:
        if text in ("inf", "-inf"):
            return None
        base, _, exp = text.partition("**")
        value = float(base) ** int(exp) if exp else float(text)
        return int(value) if value.is_integer() else value

    return Range(bound(m.group(2)), bound(m.group(3)), m.group(1) == "[", m.group(4) == "]")


PROBABILITY = "[0, 1]"
POSITIVE = "(0, inf)"
NON_NEGATIVE = "[0, inf)"
SIZE = "[1, 2**31)"  # larger model sizes and counts are not real configurations (and overflow int32 kernels)
COUNT = "[0, 2**31)"
SEED = "[0, 2**32)"
ANY = "(-inf, inf)"
# Upper bounds where a larger value is never a real setting and breaks the run (a NaN loss at
# the first steps, a timer or sleep that overflows):
LEARNING_RATE = "[0, 10]"
WEIGHT_DECAY = "[0, 10]"
WEIGHT_STD = "(0, 10]"  # standard deviation of initial weights
LOSS_WEIGHT = "[0, 100]"  # coefficient of an auxiliary loss
SECONDS = "(0, 31536000]"  # durations in seconds: at most a year

FIELD_RANGES: dict[str, str] = {
    # ---- model sizes (0 is megatron-core's "unset" default for some; the model checks report it)
    "num_layers": SIZE, "hidden_size": SIZE, "num_attention_heads": SIZE, "seq_length": SIZE,
    "num_query_groups": SIZE, "ffn_hidden_size": SIZE, "kv_channels": SIZE, "vocab_size": SIZE,
    "moe_ffn_hidden_size": SIZE, "moe_shared_expert_intermediate_size": SIZE, "num_moe_experts": SIZE,
    "moe_router_topk": SIZE, "make_vocab_size_divisible_by": SIZE, "rotary_base": "[1, 1e12]",
    "local_rotary_base": "[1, 1e12]", "attention_logit_softcap": "(0, 1000]", "output_logit_softcap": "(0, 1000]",
    "rotary_percent": "(0, 1]", "layernorm_epsilon": "(0, 1]", "init_method_std": WEIGHT_STD,
    "embedding_init_method_std": WEIGHT_STD, "seq_len_interpolation_factor": "(0, 1000]",
    "rope_scaling_factor": "(0, 1000]", "yarn_rotary_scaling_factor": "[1, 1000]",
    "yarn_original_max_position_embeddings": SIZE, "yarn_beta_fast": "(0, 1000]", "yarn_beta_slow": "(0, 1000]",
    "yarn_mscale": "[0, 100]", "yarn_mscale_all_dim": "[0, 100]", "softmax_scale": "(0, 100]", "glu_linear_offset": ANY,
    "activation_func_clamp_value": POSITIVE, "qk_clip_threshold": POSITIVE, "mtp_loss_scaling_factor": LOSS_WEIGHT,
    "moe_aux_loss_coeff": LOSS_WEIGHT, "moe_z_loss_coeff": LOSS_WEIGHT, "dsa_indexer_loss_coeff": LOSS_WEIGHT,
    "moe_input_jitter_eps": PROBABILITY,
    "moe_router_topk_scaling_factor": "(0, 1000]", "moe_expert_capacity_factor": "(0, 1000]",
    "virtual_pipeline_model_parallel_size": SIZE, "expert_tensor_parallel_size": SIZE,
    "num_layers_in_first_pipeline_stage": COUNT, "num_layers_in_last_pipeline_stage": COUNT,
    "fp8_margin": "[-128, 128]", "fp8_interval": SIZE, "fp8_amax_history_len": SIZE,
    "q_lora_rank": SIZE, "kv_lora_rank": SIZE, "mscale": "[0, 100]", "mscale_all_dim": "[0, 100]",
    "rotary_scaling_factor": "(0, 1000]", "original_max_position_embeddings": SIZE, "beta_fast": "(0, 1000]",
    "beta_slow": "(0, 1000]",
    # ---- training loop and schedule
    "micro_batch_size": SIZE, "global_batch_size": SIZE, "eval_micro_batch_size": SIZE,
    "eval_global_batch_size": SIZE, "recipe_world_size": SIZE, "train_iters": "[1, 2**63)",
    "train_samples": "[1, 2**63)",
    "exit_duration_in_mins": "(0, 5256000]", "exit_interval": "[1, 2**63)", "log_interval": "[1, 2**63)", "eval_interval": "[1, 2**63)",
    "save_interval": "[1, 2**63)", "train_sync_interval": "[1, 2**63)", "tensorboard_log_interval": "[1, 2**63)",
    "profiling_interval": "[1, 2**63)", "non_persistent_save_interval": "[1, 2**63)",
    "lr": LEARNING_RATE, "min_lr": LEARNING_RATE, "decoupled_lr": LEARNING_RATE, "decoupled_min_lr": LEARNING_RATE,
    "lr_warmup_init": LEARNING_RATE, "weight_decay": WEIGHT_DECAY, "start_weight_decay": WEIGHT_DECAY,
    "end_weight_decay": WEIGHT_DECAY, "adam_beta1": "[0, 1)", "adam_beta2": "[0, 1)", "adam_eps": "(0, 1]",
    "sgd_momentum": "[0, 1)", "muon_momentum": "[0, 1)", "muon_extra_scale_factor": "(0, 1000]",
    "clip_grad": "[0, 1e6]", "loss_scale": "(0, 2**32]", "initial_loss_scale": "(0, 2**64]",
    "min_loss_scale": "(0, 2**32]", "loss_scale_window": "[1, 2**31)", "hysteresis": "[1, 2**31)",
    "spiky_loss_factor": "(1, inf)", "mid_level_dataset_surplus": "[0, 10]",
    # ---- process groups, checkpoints, logging
    "most_recent_k": "[-1, 2**31)", "storage_writers_per_rank": SIZE, "distributed_timeout_minutes": "[1, 2**31)",
    "distributed_timeout_seconds_after_init": "[1, 2**31)", "bucket_size": "[1, 2**63)",
    "num_distributed_optimizer_instances": SIZE, "logging_level": "[0, 50]", "tensorboard_queue_size": SIZE,
    "peak_tflops_per_device": POSITIVE, "straggler_ctrlr_port": "[1, 65535]", "straggler_minmax_count": SIZE,
    "report_time_interval": POSITIVE, "gpu_relative_perf_threshold": PROBABILITY,
    "gpu_individual_perf_threshold": PROBABILITY, "num_gpu_perf_scores_to_print": COUNT,
    "token_dtype_code": "[1, 16]",
    "sequence_parallel_size": COUNT, "window_size": "[-1, 2**31)", "min_offloaded_tensor_size": "[0, 2**63)",
    "error_injection_rate": COUNT, "monitor_thread_interval": SECONDS, "monitor_process_interval": SECONDS,
    "progress_watchdog_interval": SECONDS, "heartbeat_interval": SECONDS, "max_iterations": "[1, 2**63)",
    "simulated_fault_base_delay": "[0, 31536000]",
}  # fmt: skip

NAME_RULES: tuple[tuple[str, str], ...] = (
    (r"dropout|_prob$|probability|_rate$|fraction$|percent$", PROBABILITY),
    (r"seed$", SEED),
    (r"_size$|_heads$|_dim$|_channels$|_groups$|num_sms$", SIZE),
    (r"^num_|_layers$|_count$|_topk|_len$|_length$|_limit$|_workers$|_freq$", COUNT),
    (r"_iters$|_samples$|_steps$|_step$|_step_start$|_step_end$|_interval$|_rank$|_ranks$|_iterations$|_faults$",
     "[0, 2**63)"),
    (r"_timeout$|_interval$|_time$|_wait$", SECONDS),
    (r"_coeff$|_eps$|_factor$|_alpha$", NON_NEGATIVE),
)


def numeric_kind(tp: Any) -> Optional[type]:
    """`int` or `float` if a field declared as `tp` holds numbers (or lists of them), else None."""
    if typing.get_origin(tp) in (list, tuple):
        arms = tuple(a for a in typing.get_args(tp) if a is not Ellipsis)
    else:
        arms = real_arms(tp)
    kinds = {numeric_kind(a) if typing.get_origin(a) in (list, tuple) else a for a in arms}
    return float if float in kinds else int if int in kinds else None


@functools.lru_cache(maxsize=None)
def range_of(cls_name: str, name: str, kind: type) -> Range:
    """The range of numeric field `name` of class `cls_name`: declared, by naming rule, or by type."""
    spec = FIELD_RANGES.get(f"{cls_name}.{name}") or FIELD_RANGES.get(name)
    rule = next((rule for pattern, rule in NAME_RULES if re.search(pattern, name)), None)
    return parse(spec or rule or (ANY if kind is float else "[0, 2**63)"))


@functools.lru_cache(maxsize=None)
def numeric_fields(cls: type) -> tuple[tuple[str, Range], ...]:
    """(name, range) of every numeric field of config class `cls`."""
    kinds = {name: numeric_kind(tp) for name, tp in field_types(cls).items()}
    return tuple((name, range_of(cls.__name__, name, kind)) for name, kind in kinds.items() if kind is not None)


@functools.lru_cache(maxsize=None)
def _bounds(cls: type) -> tuple[tuple[tuple[str, Any], ...], dict[str, tuple[float, float, bool, bool, Range]]]:
    """For `check`: (name, in-range default) of each numeric field, and by name its range as
    (low, high, low inclusive, high inclusive, range). A missing bound is an infinity excluded,
    so infinities and NaN never pass the comparisons."""
    fields = cls.__dataclass_fields__
    table = numeric_fields(cls)
    defaults = tuple((name, _in_range_default(fields[name].default, rng)) for name, rng in table)
    bounds = {
        name: (
            -math.inf if rng.low is None else rng.low,
            math.inf if rng.high is None else rng.high,
            rng.low is not None and rng.low_inclusive,
            rng.high is not None and rng.high_inclusive,
            rng,
        )
        for name, rng in table
    }
    return defaults, bounds


def _in_range_default(default: Any, rng: Range) -> Any:
    """`default` if it is in `rng` (a value identical to it needs no check), else a marker no
    value is identical to (some megatron-core defaults, like num_layers=0, must be set)."""
    if default is None:
        return None
    items = default if isinstance(default, (list, tuple)) else (default,)
    if default is dataclasses.MISSING or any(rng.problem(item) for item in items):
        return _NO_DEFAULT
    return default


_NO_DEFAULT = object()


def check(obj: Any, problems: Problems) -> bool:
    """Add a problem for each numeric field of config `obj` outside its range; return whether
    all were in range. A field still holding its in-range class default is not checked again."""
    ok = True
    values = obj.__dict__
    defaults, bounds = _bounds(type(obj))
    for name, default in defaults:  # kept lean: it runs for every numeric field of every section
        value = values.get(name)
        if value is default or value is None:
            continue
        low, high, low_in, high_in, rng = bounds[name]
        kind = value.__class__
        if (kind is int or kind is float) and (
            (low <= value if low_in else low < value) and (value <= high if high_in else value < high)
        ):
            continue  # the common case, without a call: a plain number in range
        for item in value if isinstance(value, (list, tuple)) else (value,):
            why = rng.problem(item)
            if why:
                problems.add(name, why, "choose a value in that range")
                ok = False
                break
    return ok
