"""Kill a training job with SIGKILL again and again; check that nothing is lost or left behind.

Each round starts the tiny test job on one save directory (resuming from its latest checkpoint),
kills its main process with SIGKILL at a random moment (half of the time while a checkpoint is
being written, synchronously or in the background), then checks:

* resumed: the job resumed from the latest checkpoint of the previous round;
* lost: a checkpoint that was complete before the kill is gone or unloadable afterwards, or the
  tracker names a checkpoint that is not complete;
* left: processes of the killed job (its helpers: checkpoint writers, managers) still alive 10 s
  after the kill.

A final round trains to the end from the last checkpoint.

    python tools/kill_campaign.py [--kills 15] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "train_tiny.py"
sys.path.insert(0, str(ROOT))

from megatron_bridge.runtime.checkpointing.layout import complete_iterations, read_tracker  # noqa: E402


def session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                found.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    return found


def start(save: Path, out: Path, async_save: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, str(SCRIPT), "--iters", "100000", "--save", str(save), "--load", str(save),
           "--save-interval", "3", "--step-sleep", "0.02", "--out", str(out)]  # fmt: skip
    if async_save:
        cmd.append("--async-save")
    log = open(out.with_suffix(".log"), "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def checkpoint_ok(save: Path, iteration: int) -> bool:
    directory = save / f"iter_{iteration:07d}"
    return directory.is_dir() and (directory / "common.pt").is_file() and (directory / "metadata.json").is_file()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kill-campaign-"))
    save = work / "ckpt"
    resumed = lost = left = during_save = 0
    previous_latest = None
    for round_ in range(args.kills):
        async_save = round_ % 2 == 1
        before = set(complete_iterations(str(save)))
        job = start(save, work / f"round{round_}", async_save)
        want_save = rng.random() < 0.5
        delay = rng.uniform(2.0, 12.0)
        deadline = time.time() + 300
        t0 = None
        while job.poll() is None and time.time() < deadline:
            log = (work / f"round{round_}.log").read_text(errors="replace")
            if t0 is None and re.search(r"iteration +\d+/", log):
                t0 = time.time()  # training has started
            if t0 is not None:
                saving = any(save.glob("iter_*.incomplete"))
                if (want_save and saving) or (not want_save and time.time() - t0 > delay) or time.time() - t0 > 60:
                    during_save += saving
                    break
            time.sleep(0.01)
        job.send_signal(signal.SIGKILL)
        job.wait()
        time.sleep(10)
        remaining = [p for p in session_processes(job.pid)]
        left += len(remaining)
        for p in remaining:
            p.kill()
        log = (work / f"round{round_}.log").read_text(errors="replace")
        if previous_latest is not None and f"resumed from iteration {previous_latest} " in log:
            resumed += 1
        latest = read_tracker(str(save)) if save.is_dir() else None
        gone = [it for it in before if not checkpoint_ok(save, it)]
        bad_latest = latest is not None and not checkpoint_ok(save, latest)
        lost += len(gone) + int(bad_latest)
        print(
            f"round {round_ + 1:2d}: {'async' if async_save else 'sync '} save, killed "
            f"{'during a save' if any(save.glob('iter_*.incomplete')) else 'while training'}; latest {latest}; "
            f"resumed from {previous_latest if previous_latest is not None and f'resumed from iteration {previous_latest} ' in log else '-'}; "
            f"lost {len(gone) + int(bad_latest)}; processes left {len(remaining)}",
            flush=True,
        )
        previous_latest = latest
    # the last checkpoint must load and training must go on from it
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    final_iters = (previous_latest or 0) + 3
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--iters", "100000", "--exit-interval", "3", "--save", str(save),
         "--load", str(save), "--out", str(work / "final")], env=env, capture_output=True, text=True,  # fmt: skip
    )
    final_ok = done.returncode == 0 and read_tracker(str(save)) == final_iters
    print(
        f"\n{args.kills} kills ({during_save} during a save): resumed {resumed} of {args.kills - 1}, "
        f"checkpoints lost {lost}, processes left {left}; final run to iteration {final_iters}: "
        f"{'ok' if final_ok else 'FAILED'}\n(work directory: {work})"
    )
    return 0 if lost == 0 and left == 0 and final_ok and resumed == args.kills - 1 else 1


if __name__ == "__main__":
    sys.exit(main())
