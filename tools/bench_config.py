"""Cost of the config layer, measured side by side in one run.

    python tools/bench_config.py [--rounds 5]

1. Import time of `megatron_bridge.training.config` over `import megatron.core` alone, each in a
   fresh interpreter, alternating (target <= 1.10).
2. `runtime_config_update` on the Llama 3 8B and Llama 3.1 405B recipes after imports, on fresh
   copies (target <= 0.40 ms); 50 CLI overrides applied to the 8B recipe (target <= 1 ms) and its
   YAML round trip, `to_yaml` + `from_yaml` (target <= 15 ms), as `tools/bench_config_io.py`
   measures them. `--config-only` prints these alone.
0. Wall time of `mbridge --help`, `mbridge recipes` and `mbridge pretrain --help` (fresh
   processes, median of --rounds; target <= 1 s each), next to `import megatron.core`.
3. The planner (`megatron_bridge.planning.plan`) on the resolved Llama 3.1 405B recipe (target
   <= 50 ms), and, for scale, on Llama 3 70B squeezed onto 8 GPUs at TP 1, which does not fit and
   so also searches for fixes.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time

IMPORT = "import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"


def import_seconds(module: str) -> float:
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", IMPORT.format(module=module)], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def command_seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_bridge", *argv], capture_output=True, check=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--updates", type=int, default=200)
    p.add_argument("--plans", type=int, default=30)
    p.add_argument("--config-only", action="store_true", help="only runtime_config_update, overrides and YAML")
    args = p.parse_args()
    if args.config_only:
        config_layer(args.updates)
        return

    import_seconds("megatron.core")  # warm the file-system cache for both
    commands = (["--help"], ["recipes"], ["pretrain", "--help"])
    command_times: dict[str, list[float]] = {" ".join(c): [] for c in commands}
    core_import = []
    for _ in range(args.rounds):
        core_import.append(import_seconds("megatron.core"))
        for argv in commands:
            command_times[" ".join(argv)].append(command_seconds(argv))
    print(f"import megatron.core (for scale)        median {statistics.median(core_import):.3f} s")
    for label, times in command_times.items():
        print(f"mbridge {label:31s} median {statistics.median(times):.3f} s (target <= 1 s; whole process)")
    core, ours = [], []
    for _ in range(args.rounds):
        core.append(import_seconds("megatron.core"))
        ours.append(import_seconds("megatron_bridge.training.config"))
    core_s, ours_s = statistics.median(core), statistics.median(ours)
    print(f"import megatron.core                    median {core_s:.3f} s")
    print(f"import megatron_bridge.training.config  median {ours_s:.3f} s")
    print(f"ratio {ours_s / core_s:.3f} (target <= 1.10; {args.rounds} alternating rounds, fresh interpreters)")

    config_layer(args.updates)

    from megatron_bridge.planning import plan
    from megatron_bridge.training.config import runtime_config_update
    from recipes import get_recipe

    fn = get_recipe("llama31_405b_pretrain_config")
    cfg = fn()
    runtime_config_update(cfg, world_size=fn.world_size)
    median = _plan_ms(plan, cfg, args.plans)
    print(f"planner llama31_405b_pretrain_config at {fn.world_size} GPUs: median {median:.2f} ms "
          f"(target <= 50 ms; fits: {plan(cfg).fits})")
    squeezed = get_recipe("llama3_70b_pretrain_config")(tensor_model_parallel_size=1, sequence_parallel=False,
                                                        tp_comm_overlap=False)
    runtime_config_update(squeezed, world_size=8)
    result = plan(squeezed)
    print(f"planner llama3_70b_pretrain_config at 8 GPUs, TP 1 (does not fit, {len(result.fixes)} fixes searched "
          f"and re-planned): median {_plan_ms(plan, squeezed, max(3, args.plans // 10)):.1f} ms (no target)")


def config_layer(updates: int) -> None:
    import logging

    logging.disable(logging.WARNING)  # comm-overlap notes would be printed on every update
    from megatron_bridge.training.config import runtime_config_update
    from recipes import get_recipe

    for name in ("llama3_8b_pretrain_config", "llama31_405b_pretrain_config"):
        fn = get_recipe(name)
        template = fn()
        copies = [copy.deepcopy(template) for _ in range(updates)]
        runtime_config_update(copy.deepcopy(template), world_size=fn.world_size)  # warm caches
        times = []
        for cfg in copies:
            start = time.perf_counter()
            runtime_config_update(cfg, world_size=fn.world_size)
            times.append(time.perf_counter() - start)
        median_ms = statistics.median(times) * 1e3
        print(f"runtime_config_update {name:30s} median {median_ms:.3f} ms (target <= 0.40 ms)")

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_config_io import measure

    overrides_ms, trip_ms = measure(repeat=20)
    print(f"apply 50 CLI overrides (8B recipe)       median {statistics.median(overrides_ms[1:]):.3f} ms "
          f"(target <= 1 ms; first call {overrides_ms[0]:.2f} ms)")
    print(f"to_yaml + from_yaml round trip (8B)     median {statistics.median(trip_ms[1:]):.2f} ms "
          f"(target <= 15 ms; first call {trip_ms[0]:.2f} ms)")


def _plan_ms(plan, cfg, rounds: int) -> float:
    plan(cfg)  # warm
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        plan(cfg)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    main()
