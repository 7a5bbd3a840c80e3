"""Test-suite instrumentation, off unless asked for.

TEST_CPU_TIMES=N (N > 0: the N most expensive tests; 0: all of them) prints, at the end of the
run, each test's CPU seconds (this process, its threads included, plus the children it waited
for: subprocesses, torchrun and its ranks), its wall seconds, and the totals per file. Setup and
teardown count with the test that ran them (a session fixture counts where it is first built).

TEST_FAILURE_LOG=FILE appends each failure's traceback to FILE as soon as the test ends (pytest
prints them only at the end of the run, which a run cut short by a time limit never reaches).
"""

from __future__ import annotations

import os
import resource
import time

import pytest

_LIMIT = os.environ.get("TEST_CPU_TIMES")
_times: dict[str, tuple[float, float, float]] = {}  # nodeid -> (own cpu, children's cpu, wall)
_START = (time.process_time(), time.perf_counter())


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if _LIMIT is not None:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        own, children, wall = time.process_time(), _children_cpu(), time.perf_counter()
        yield
        _times[item.nodeid] = (
            time.process_time() - own,
            _children_cpu() - children,
            time.perf_counter() - wall,
        )

    def pytest_terminal_summary(terminalreporter):
        write = terminalreporter.write_line
        rows = sorted(_times.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
        limit = int(_LIMIT or 0)
        shown = rows[:limit] if limit > 0 else rows
        terminalreporter.section("CPU seconds per test (own + children), wall seconds")
        write(f"{'cpu':>8} {'own':>8} {'child':>8} {'wall':>8}  test")
        for nodeid, (own, child, wall) in shown:
            write(f"{own + child:8.1f} {own:8.1f} {child:8.1f} {wall:8.1f}  {nodeid}")
        per_file: dict[str, list[float]] = {}
        for nodeid, (own, child, wall) in rows:
            totals = per_file.setdefault(nodeid.split("::")[0], [0.0, 0.0, 0.0])
            totals[0] += own + child
            totals[1] += wall
            totals[2] += 1
        terminalreporter.section("CPU seconds per file, wall seconds, tests")
        for path, (cpu, wall, count) in sorted(per_file.items(), key=lambda kv: -kv[1][0]):
            write(f"{cpu:8.1f} {wall:8.1f} {int(count):5d}  {path}")
        total_cpu = sum(own + child for own, child, _ in _times.values())
        total_wall = sum(wall for _, _, wall in _times.values())
        write(f"total: {total_cpu:.1f} CPU s, {total_wall:.1f} wall s over {len(_times)} tests")
        whole_cpu = time.process_time() - _START[0] + _children_cpu()
        write(f"whole run: {whole_cpu:.1f} CPU s, {time.perf_counter() - _START[1]:.1f} wall s (with collection)")


_FAILURE_LOG = os.environ.get("TEST_FAILURE_LOG")

if _FAILURE_LOG:

    def pytest_runtest_logreport(report):
        # with xdist this runs in the controller as each worker's report arrives
        if report.failed:
            with open(_FAILURE_LOG, "a", encoding="utf-8") as log:
                log.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
