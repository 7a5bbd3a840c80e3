"""Which linear layers a PEFT method adapts: target names and patterns against module names.

Module names are *global*: `decoder.layers.<L>.self_attention.linear_qkv`, with L the layer's number
in the whole model (not its index in a pipeline stage), and `...mlp.experts.local_experts.<E>.
linear_fc1` with E the expert's number over all expert-parallel ranks. So a pattern means the same
module whatever the parallel layout.

A target is either a bare module name (`linear_qkv`: every module called that) or a dotted
pattern matched against the whole name with shell wildcards (`*.layers.0.*.linear_qkv`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import Any, Optional

ADAPTABLE = (
    "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
    "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
)  # fmt: skip
"""Module names that adapters wrap: the linear layers of attention and MLPs (also in MoE experts);
multi-latent attention has its query and key/value projections in place of `linear_qkv`."""

_PATTERN_CHARS = re.compile(r"^[A-Za-z0-9_.*?\[\]!-]+$")


def pattern_problem(pattern: Any) -> Optional[str]:
    """Why `pattern` is not a usable target (None if it is)."""
    if not isinstance(pattern, str) or not pattern:
        return "a target must be a non-empty string"
    if not _PATTERN_CHARS.match(pattern):
        return "contains characters that appear in no module name"
    return None


def is_pattern(target: str) -> bool:
    return "." in target or any(c in target for c in "*?[")


def matches(target: str, name: str) -> bool:
    """Whether `target` selects the module called `name` (a global dotted name)."""
    if is_pattern(target):
        return fnmatch.fnmatchcase(name, target)
    return name.rsplit(".", 1)[-1] == target


def match_targets(targets: Iterable[str], names: Iterable[str]) -> tuple[list[str], list[str]]:
    """(names selected by any target, targets that select none)."""
    names = list(names)
    targets = list(targets)
    selected = [n for n in names if any(matches(t, n) for t in targets)]
    unmatched = [t for t in targets if not any(matches(t, n) for n in names)]
    return selected, unmatched


def describe_valid(names: list[str], limit: int = 6) -> str:
    """The valid targets of a model, for an error message."""
    short = sorted({n.rsplit(".", 1)[-1] for n in names}, key=ADAPTABLE.index)
    examples = ", ".join(names[:limit])
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return f"valid names: {', '.join(short)}; or patterns over the full names: {examples}{more}"


# ---------------------------------------------------------------------- from a model config
def moe_layers(model_cfg: Any) -> list[bool]:
    """For each layer, whether it is a mixture-of-experts layer (megatron-core's moe_layer_freq)."""
    n = model_cfg.num_layers
    if not model_cfg.num_moe_experts:
        return [False] * n
    freq = model_cfg.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(n)]
    return [bool(x) for x in list(freq)[:n]]


def expected_names(model_cfg: Any) -> list[str]:
    """The global names of the adaptable modules that `model_cfg` builds with megatron-core's
    layer specs (used to check targets before the model exists)."""
    names = []
    if getattr(model_cfg, "multi_latent_attention", False):
        query = ["linear_q_down_proj", "linear_q_up_proj"] if model_cfg.q_lora_rank else ["linear_q_proj"]
        attention = [*query, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    else:
        attention = ["linear_qkv", "linear_proj"]
    for layer, moe in enumerate(moe_layers(model_cfg)):
        base = f"decoder.layers.{layer}"
        names += [f"{base}.self_attention.{module}" for module in attention]
        if not moe:
            names += [f"{base}.mlp.linear_fc1", f"{base}.mlp.linear_fc2"]
            continue
        for e in range(model_cfg.num_moe_experts):
            names += [
                f"{base}.mlp.experts.local_experts.{e}.linear_fc1",
                f"{base}.mlp.experts.local_experts.{e}.linear_fc2",
            ]
        if model_cfg.moe_shared_expert_intermediate_size:
            names += [f"{base}.mlp.shared_experts.linear_fc1", f"{base}.mlp.shared_experts.linear_fc2"]
    return names


def is_expert_name(name: str) -> bool:
    return ".experts." in name


# ---------------------------------------------------------------------- in a built model
_LAYER = re.compile(r"^(.*?\bdecoder\.layers\.)(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)\.(.*)$")


def global_name(local_name: str, layer_number: Optional[int], expert_offset: int) -> str:
    """The global name of a module of one pipeline stage / expert-parallel rank.

    `layer_number` is megatron-core's 1-based global `TransformerLayer.layer_number` of the layer
    the module sits in; `expert_offset` the global number of this rank's first local expert."""
    name = local_name
    if layer_number is not None:
        m = _LAYER.match(name)
        if m:
            name = f"{m.group(1)}{layer_number - 1}.{m.group(3)}"
    m = _EXPERT.match(name)
    if m:
        name = f"{m.group(1)}{int(m.group(2)) + expert_offset}.{m.group(3)}"
    return name


def adaptable_modules(chunk: Any) -> list[tuple[str, str, Any, Any]]:
    """(global name, local name, module, parent) of every module of `chunk` named like an
    adaptable layer, in module order."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    found = []
    layer_number: dict[str, int] = {}
    modules = dict(chunk.named_modules())
    for local, module in modules.items():
        if isinstance(module, TransformerLayer):
            layer_number[local] = module.layer_number
        leaf = local.rsplit(".", 1)[-1]
        if leaf not in ADAPTABLE:
            continue
        parent_name = local.rsplit(".", 1)[0] if "." in local else ""
        layer = next((n for prefix, n in layer_number.items() if local.startswith(prefix + ".")), None)
        expert_offset = _expert_offset(modules, local)
        found.append((global_name(local, layer, expert_offset), local, module, modules[parent_name]))
    return found


def _expert_offset(modules: dict, local: str) -> int:
    m = _EXPERT.match(local)
    if not m:
        return 0
    experts = modules.get(m.group(1).rstrip(".").rsplit(".", 1)[0])  # the SequentialMLP
    group = getattr(experts, "ep_group", None)
    if group is None:
        return 0
    return group.rank() * experts.num_local_experts
