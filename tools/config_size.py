"""Lines of the config layer and of its machinery, against their targets.

    python tools/config_size.py

The machinery is the generic code that turns configs into and out of text (codec, serialization,
annotations, base, overrides, targets, apply, yaml_input, interpolation); the config layer is
everything under megatron_bridge/config/ and megatron_bridge/training/config/ (sections, tables,
rules and the machinery). Lines are counted as `wc -l` counts them.
"""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MACHINERY = ("codec", "serialization", "annotations", "base", "overrides", "targets", "apply", "yaml_input",
             "interpolation")  # fmt: skip
LAYER_DIRS = ("megatron_bridge/config", "megatron_bridge/training/config")
MACHINERY_TARGET, LAYER_TARGET = 1800, 6091


def lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def main() -> None:
    machinery = {}
    for name in MACHINERY:
        path = os.path.join(REPO, "megatron_bridge/config", name + ".py")
        if os.path.exists(path):
            machinery[name] = lines(path)
    layer = {}
    for directory in LAYER_DIRS:
        for root, _, files in os.walk(os.path.join(REPO, directory)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    layer[os.path.relpath(path, REPO)] = lines(path)
    print("machinery: " + ", ".join(f"{n} {c}" for n, c in machinery.items()))
    total = sum(machinery.values())
    verdict = "met" if total <= MACHINERY_TARGET else "not met"
    print(f"machinery total: {total} lines (target at most {MACHINERY_TARGET}: {verdict})")
    whole = sum(layer.values())
    print(f"config layer: {whole} lines in {len(layer)} files (target below {LAYER_TARGET}: "
          f"{'met' if whole < LAYER_TARGET else 'not met'})")  # fmt: skip
    for path, count in sorted(layer.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {count:5d}  {path}")


if __name__ == "__main__":
    main()
