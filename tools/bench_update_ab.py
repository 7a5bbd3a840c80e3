"""`runtime_config_update`, 50 CLI overrides and the YAML round trip of two source trees, side by
side in one run.

    python tools/bench_update_ab.py OTHER_TREE [--blocks 10] [--per-block 40]

OTHER_TREE is a checkout of another commit (`git worktree add /tmp/old COMMIT`). One worker
process per tree imports its own megatron_bridge and recipes; the workers then time blocks of
updates in turn (A, B, A, B, ...), so both see the same machine load. The garbage collector is
off while a block runs (it would otherwise collect the block's 40 live copies at random points).
Printed: the median time per update of each tree on the Llama 3 8B and Llama 3.1 405B recipes,
then per application of `tools/bench_config_io.py`'s 50 overrides and per `to_yaml` + `from_yaml`
of the 8B recipe (blocks of a quarter the size), their ratio (this tree / other tree), and the median of the ratios of neighbouring blocks (less
sensitive to the machine's speed drifting during the run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

WORKER = r"""
import copy, gc, logging, os, sys, tempfile, time
logging.disable(logging.WARNING)
from megatron_bridge.training.config import ConfigContainer, runtime_config_update
from megatron_bridge.config.overrides import process_config_with_overrides
from megatron_bridge.config.serialization import from_yaml, to_yaml
from recipes import get_recipe
sys.path.insert(0, sys.argv[1])
from bench_config_io import OVERRIDES
templates = {}
for name in ("llama3_8b_pretrain_config", "llama31_405b_pretrain_config"):
    fn = get_recipe(name)
    templates[name] = (fn(), fn.world_size if hasattr(fn, "world_size") else 8)
    runtime_config_update(copy.deepcopy(templates[name][0]), world_size=templates[name][1])  # warm caches
base = templates["llama3_8b_pretrain_config"][0]
path = os.path.join(tempfile.mkdtemp(), "config.yaml")
process_config_with_overrides(copy.deepcopy(base), cli_overrides=OVERRIDES)
from_yaml(to_yaml(base, path) and path, ConfigContainer)
print("ready", flush=True)
for line in sys.stdin:
    name, n = line.split()
    times = []
    if name in templates:
        template, world = templates[name]
        copies = [copy.deepcopy(template) for _ in range(int(n))]
        gc.collect()
        gc.disable()  # collections of the block's own copies would land in random updates
        for cfg in copies:
            start = time.perf_counter()
            runtime_config_update(cfg, world_size=world)
            times.append(time.perf_counter() - start)
        gc.enable()
    elif name == "overrides":
        copies = [copy.deepcopy(base) for _ in range(int(n))]
        for cfg in copies:
            start = time.perf_counter()
            process_config_with_overrides(cfg, cli_overrides=OVERRIDES)
            times.append(time.perf_counter() - start)
    else:  # the round trip, the collector on as in a real process
        for _ in range(int(n)):
            start = time.perf_counter()
            to_yaml(base, path)
            from_yaml(path, ConfigContainer)
            times.append(time.perf_counter() - start)
    print(" ".join(map(str, times)), flush=True)
"""


def start(tree: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=tree)
    tools = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c", WORKER, tools], cwd=tree, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"the worker for {tree} did not start")
    return proc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("other", help="source tree of the commit to compare with")
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--per-block", type=int, default=40)
    args = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    workers = {"this": start(here), "other": start(os.path.abspath(args.other))}
    for name in ("llama3_8b_pretrain_config", "llama31_405b_pretrain_config", "overrides", "round_trip"):
        per_block = args.per_block if name.endswith("_config") else max(3, args.per_block // 4)
        times: dict[str, list[float]] = {k: [] for k in workers}
        pair_ratios = []
        for i in range(args.blocks):
            block = {}
            for label, proc in sorted(workers.items(), reverse=i % 2 == 1):  # who goes first alternates
                proc.stdin.write(f"{name} {per_block}\n")
                proc.stdin.flush()
                block[label] = [float(t) for t in proc.stdout.readline().split()]
                times[label] += block[label]
            pair_ratios.append(statistics.median(block["this"]) / statistics.median(block["other"]))
        this, other = (statistics.median(times[k]) * 1e3 for k in ("this", "other"))
        what = f"runtime_config_update {name}" if name.endswith("_config") else name
        print(f"{what:52s} this {this:.3f} ms, other {other:.3f} ms, "
              f"ratio {this / other:.2f}; median of block ratios {statistics.median(pair_ratios):.2f} "
              f"({args.blocks} alternating blocks of {per_block})")
    for proc in workers.values():
        proc.stdin.close()
        proc.wait()


if __name__ == "__main__":
    main()
