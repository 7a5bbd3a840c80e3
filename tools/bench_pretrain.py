"""Overhead of pretrain() over a hand-written megatron-core loop, measured side by side.

    python tools/bench_pretrain.py [--rounds 3] [--iters 80]

Alternates fresh processes of both loops (tools/bench_loops.py) and prints, per loop, the median
per-iteration time (first 10 iterations excluded) and the time from process start to the end of
the first iteration, then the ratios pretrain / hand-written (targets: <= 1.03 per iteration,
<= 1.25 to the first iteration).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 10


def run_once(kind: str, iters: int) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "bench_loops.py"), kind, str(iters)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = next(line for line in out.stdout.splitlines() if line.startswith("BENCH "))
    return json.loads(line[len("BENCH ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=80)
    args = p.parse_args()
    results: dict[str, list[dict]] = {"handwritten": [], "pretrain": []}
    for _ in range(args.rounds):
        for kind in results:
            results[kind].append(run_once(kind, args.iters))
    summary = {}
    for kind, runs in results.items():
        per_iter = statistics.median(t for r in runs for t in r["iteration_times"][WARMUP:])
        first = statistics.median(r["first_iteration_end"] for r in runs)
        summary[kind] = (per_iter, first)
        print(f"{kind:12s} median s/iteration {per_iter:.4f}   process start -> end of first iteration {first:.2f} s")
    hand, ours = summary["handwritten"], summary["pretrain"]
    print(f"ratio pretrain/hand-written: per iteration {ours[0] / hand[0]:.3f} (target <= 1.03), "
          f"to first iteration {ours[1] / hand[1]:.3f} (target <= 1.25)")  # fmt: skip
    print(f"({args.rounds} rounds x {args.iters} iterations each, alternating fresh processes)")


if __name__ == "__main__":
    main()
