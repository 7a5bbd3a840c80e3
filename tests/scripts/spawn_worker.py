"""A stand-in trainer that spawns a helper the way megatron-core starts its persistent checkpoint
worker (the target a static method looked up on its class when the process starts), tied to this
process (`tie_spawned_target`) or not, writes the helper's pid to PIDFILE and waits to be killed.

    python tests/scripts/spawn_worker.py PIDFILE tied|untied
"""

import multiprocessing as mp
import os
import sys
import time

from megatron_bridge.runtime.child_processes import tie_spawned_target


class Worker:
    @staticmethod
    def loop(pid_file: str) -> None:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        time.sleep(300)  # a worker blocked on its job queue


if __name__ == "__main__":
    pid_file, mode = sys.argv[1:]
    if mode == "tied":
        tie_spawned_target(Worker, "loop")
    mp.get_context("spawn").Process(target=Worker.loop, args=(pid_file,)).start()
    time.sleep(300)
