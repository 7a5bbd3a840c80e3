"""Experiment trackers in a helper process.

Tracker backends spend milliseconds of Python per log step (protobuf and JSON encoding, SQL
through SQLAlchemy, file writes). In a thread of the training process that time still holds the
GIL that the train loop needs, so the trackers run in a child Python process: the training
process only pickles each log step's metrics onto a pipe (tens of microseconds). The child
(`worker.py`) batches what arrived and hands it to the backends.
"""

from __future__ import annotations

import builtins
import logging
import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Mapping

from megatron_bridge.config.errors import RunStartError
from megatron_bridge.training.loggers.base import Record, Tracker, plain

logger = logging.getLogger("megatron_bridge")


class TrackerProcess(Tracker):
    """Proxy for the trackers that `specs` describe, built and run in a child process.

    Creation returns at once (the child imports and connects meanwhile); `log_config` waits until
    every tracker has started and raises the error of one that could not.
    """

    name = "trackers"

    def __init__(self, specs: list, start_timeout: float = 300.0, close_timeout: float = 600.0):
        self.names = [spec.name for spec in specs]
        self.start_timeout, self.close_timeout = start_timeout, close_timeout
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_bridge.training.loggers.worker", str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
            env=_child_env(),
        )
        os.close(to_child_r)
        os.close(from_child_w)
        _enlarge_pipe(to_child_w)
        self._out = Connection(to_child_w, readable=False)
        self._in = Connection(from_child_r, writable=False)
        self._ready = False
        self._start_failed = False
        self._lost = False
        self._send(("specs", specs))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if not self._ready:
            self._wait_ready()
        self._send(("metrics", Record(step, dict(metrics), time.time())))

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._send(("config", plain(config)))
        self._wait_ready()

    def close(self, failed: bool = False) -> None:
        errors: list[str] = []
        try:
            if not self._start_failed:  # else the child has exited, and its error was raised
                self._send(("close", failed))
                errors = self._closing_reply()
        finally:
            self._out.close()
            self._in.close()
            self._exit_code()
        if errors:
            raise RuntimeError("; ".join(errors))

    # ------------------------------------------------------------------ internals
    def _send(self, message: tuple) -> None:
        if self._lost:
            return
        try:
            self._out.send(message)
        except OSError:
            self._lost = True
            if self._ready:
                logger.warning(
                    "the experiment tracker process exited (code %s): metrics are no longer recorded",
                    self.proc.poll(),
                )

    def _wait_ready(self) -> None:
        reply = self._receive(self.start_timeout, "start")
        if reply[0] == "error":
            self._start_failed = True
            raise _rebuild(reply[1], reply[2])
        self._ready = True

    def _closing_reply(self) -> list[str]:
        if not self._ready:
            try:
                reply = self._receive(self.start_timeout, "start")
            except RuntimeError as exc:
                return [str(exc)]
            if reply[0] == "error":  # setup failed before it could ask
                return [reply[2]]
            self._ready = True
        try:
            reply = self._receive(self.close_timeout, "finish")
        except RuntimeError as exc:
            self.proc.kill()
            return [str(exc)]
        return list(reply[1])

    def _receive(self, timeout: float, what: str) -> tuple:
        if not self._in.poll(timeout):
            raise RuntimeError(
                f"the experiment trackers ({', '.join(self.names)}) did not {what} within {timeout:.0f} s"
            )
        try:
            return self._in.recv()
        except EOFError:
            code = self._exit_code()
            raise RuntimeError(
                f"the experiment tracker process exited with code {code} before it could {what} "
                f"({', '.join(self.names)}; its output above says why)"
            ) from None

    def _exit_code(self) -> int:
        """Wait for the child to exit (it does once its pipe closes); kill it if it hangs."""
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _rebuild(type_name: str, message: str) -> Exception:
    """The child's exception as the same built-in type (else RuntimeError), with its message; it is
    a `RunStartError` too."""
    kind = getattr(builtins, type_name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return type(kind.__name__, (kind, RunStartError), {})(message)
        except TypeError:
            pass
    return type("RuntimeError", (RuntimeError, RunStartError), {})(f"{type_name}: {message}")


def _enlarge_pipe(fd: int) -> None:
    # Room for thousands of log steps: the training process blocks on a full pipe, which the
    # tracker process (at idle priority) empties only when a CPU is free.
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
    except (ImportError, AttributeError, OSError):
        pass  # not Linux, or above the system's limit: the default pipe size works too


def _child_env() -> dict[str, str]:
    # The child must import this package even where the parent found it through sys.path tweaks.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env
