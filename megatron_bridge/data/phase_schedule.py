"""Blend phases: the weights of a data mixture change at given iterations.

`dataset.blend_phases` lists the phases, each a mapping with
- `weights`: one weight per blend prefix (a 0 leaves a dataset out of the phase),
- `start_iteration` (or `start_fraction` of `train.train_iters`): where the phase begins,
- `name` (optional): shown on the console.
Phases start in increasing order. Before the first phase (if it does not start at 0) the
blend's own weights apply. Example, an annealing phase on the second dataset for the last 10%::

    dataset.data_path: "0.7 /data/web 0.3 /data/books"
    dataset.blend_phases: [{name: anneal, start_fraction: 0.9, weights: [0.2, 0.8]}]

This module is plain Python: config checks use it without the training stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from megatron_bridge.config.errors import Problems

PHASE_KEYS = ("name", "start_iteration", "start_fraction", "weights")


@dataclass(frozen=True)
class Phase:
    """One resolved phase: its weights (normalized) from `start_iteration` on."""

    name: str
    start_iteration: int
    weights: tuple[float, ...]


def check_phases(phases: Any, num_prefixes: Optional[int], problems: Problems, path: str = "blend_phases") -> None:
    """The structure of `blend_phases` (what can be checked without train_iters)."""
    if not isinstance(phases, list) or not phases:
        problems.add(path, f"must be a non-empty list of phases, got {phases!r}", "e.g. [{start_iteration: 900, weights: [0.2, 0.8]}]")
        return
    for i, phase in enumerate(phases):
        where = f"{path}.{i}"
        if not isinstance(phase, dict):
            problems.add(where, f"a phase is a mapping, got {phase!r}", "use {start_iteration: N, weights: [...]}")
            continue
        unknown = sorted(set(phase) - set(PHASE_KEYS))
        problems.check(not unknown, where, f"unknown key(s) {unknown}", f"use {list(PHASE_KEYS)}")
        starts = [k for k in ("start_iteration", "start_fraction") if k in phase]
        if problems.check(len(starts) == 1, where, f"needs exactly one of start_iteration and start_fraction, got {starts or 'neither'}", "give one"):
            value = phase[starts[0]]
            if starts[0] == "start_iteration":
                problems.check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, f"{where}.start_iteration", f"must be an integer >= 0, got {value!r}", "e.g. 900")
            else:
                problems.check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1, f"{where}.start_fraction", f"must be within [0, 1), got {value!r}", "e.g. 0.9 for the last 10%")
        weights = phase.get("weights")
        ok = isinstance(weights, list) and all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights) and sum(weights or []) > 0
        if problems.check(ok, f"{where}.weights", f"must be a list of weights >= 0 with a positive sum, got {weights!r}", "e.g. [0.2, 0.8]"):
            if num_prefixes is not None:
                problems.check(len(weights) == num_prefixes, f"{where}.weights", f"{len(weights)} weights for {num_prefixes} blend prefixes", "give one weight per prefix of the blend, in its order")
        if "name" in phase:
            problems.check(isinstance(phase["name"], str) and phase["name"], f"{where}.name", f"must be a non-empty string, got {phase['name']!r}", "e.g. anneal")


def resolve_phases(phases: list[dict], base_weights: Optional[list[float]], train_iters: int, problems: Problems, path: str = "dataset.blend_phases") -> list[Phase]:
    """Phases with start iterations, the first at 0 (the blend's own weights until the first
    given phase starts, when that is later)."""
    resolved = []
    for i, phase in enumerate(phases):
        if "start_iteration" in phase:
            start = int(phase["start_iteration"])
        else:
            start = int(math.floor(float(phase["start_fraction"]) * train_iters))
        total = float(sum(phase["weights"]))
        resolved.append(Phase(phase.get("name") or f"phase {i + 1}", start, tuple(float(w) / total for w in phase["weights"])))
    for i, (a, b) in enumerate(zip(resolved, resolved[1:])):
        problems.check(b.start_iteration > a.start_iteration, f"{path}.{i + 1}", f"starts at iteration {b.start_iteration}, not after the previous phase ({a.start_iteration})", "give phases in increasing order of start")
    for i, phase in enumerate(resolved):
        problems.check(phase.start_iteration < train_iters, f"{path}.{i}", f"starts at iteration {phase.start_iteration}, at or after the end of training (train.train_iters={train_iters})", "start it earlier or train longer")
    if resolved and resolved[0].start_iteration > 0:
        if problems.check(base_weights is not None, path, f"the first phase starts at iteration {resolved[0].start_iteration} and the blend has no weights for the iterations before it", "start the first phase at 0, or give weights in dataset.data_path"):
            total = float(sum(base_weights))
            resolved.insert(0, Phase("base", 0, tuple(float(w) / total for w in base_weights)))
    return resolved


def phase_at(phases: list[Phase], iteration: int) -> int:
    """Index of the phase that iteration `iteration` (0-based: the step about to run) draws from."""
    index = 0
    for i, phase in enumerate(phases):
        if phase.start_iteration <= iteration:
            index = i
    return index


def describe(phases: list[Phase], index: int, prefixes: list[str]) -> str:
    """e.g. `data phase 2/2 'anneal' from iteration 90: web 0.20, books 0.80`"""
    phase = phases[index]
    import os

    weights = ", ".join(f"{os.path.basename(p)} {w:.2f}" for p, w in zip(prefixes, phase.weights))
    return f"data phase {index + 1}/{len(phases)} {phase.name!r} from iteration {phase.start_iteration}: {weights}"
