"""What the logging rank prints: one line per log step with a progress indicator, and
evaluation results."""

from __future__ import annotations

import datetime
import logging
import math
import os
import sys
from typing import Mapping, Optional

logger = logging.getLogger("megatron_bridge")

CONSOLE_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
"""strftime format of the timestamp that starts every console line."""


def log_to_console(level: Optional[int], logging_rank: bool) -> None:
    """The project's log lines on stdout: those of `level` (default INFO) from the logging rank,
    warnings from every other rank; unless the application configured logging itself."""
    level = level if level is not None else logging.INFO
    logger.setLevel(level if logging_rank else max(level, logging.WARNING))
    if not logging.getLogger().handlers and not any(getattr(h, "_mb_console", False) for h in logger.handlers):
        handler = ConsoleHandler(sys.stdout)
        # Timestamped like Megatron-LM's console lines, so a log can be lined up with other logs.
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", datefmt=CONSOLE_TIME_FORMAT))
        handler._mb_console = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False


class ConsoleHandler(logging.StreamHandler):
    """The logging rank's lines on stdout. When the reader of a pipe goes away (`mbridge pretrain
    | head`), the run goes on without them (its checkpoints and trackers are what it leaves),
    instead of printing a logging traceback for every line: stdout then writes to /dev/null,
    which also keeps later prints from failing."""

    def handleError(self, record: logging.LogRecord) -> None:
        if not isinstance(sys.exc_info()[1], BrokenPipeError):
            super().handleError(record)
            return
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # a stream without a file descriptor
            self.setStream(open(os.devnull, "w"))
        try:
            print("megatron_bridge: stdout was closed (the reader of its pipe ended); going on "
                  "without console lines", file=sys.stderr)  # fmt: skip
        except OSError:
            pass  # stderr went the same way


def perplexity(loss: float) -> float:
    """e^loss, capped at e^20 as Megatron-LM shows it; NaN for a NaN loss (no loss tokens)."""
    return math.nan if math.isnan(loss) else math.exp(min(20.0, loss))


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    return str(datetime.timedelta(seconds=int(round(seconds))))


def train_line(step: int, total: int, metrics: Mapping[str, float], eta_seconds: float, phase: Optional[str] = None) -> str:
    """e.g. `[ 33%] iter 10/30 | samples 80 | 16.2 ms/iter | 15.8k tok/s | lr 2.70E-03 | lm loss 4.812E+00 | ...`;
    `phase` (the active data phase of a phased blend) follows the batch size."""
    percent = 100.0 * step / total if total else 100.0
    parts = [
        f"[{percent:3.0f}%] iteration {step:>{len(str(total))}}/{total}",
        f"consumed samples {int(metrics['consumed-samples'])}",
        f"{metrics['iteration-time'] * 1000:.1f} ms/iter",
        f"{metrics['tokens-per-second']:.0f} tokens/s",
        f"lr {metrics['learning-rate']:.3E}",
        f"batch {int(metrics['batch-size'])}",
    ]
    if phase:
        parts.append(f"data {phase}")
    if "lm loss" in metrics:
        parts.append(f"lm loss {metrics['lm loss']:.4E}")
    for key in sorted(metrics):
        if key.endswith((" loss", "_loss")) and key != "lm loss":  # also the MoE routers' (z_loss, ...)
            parts.append(f"{key} {metrics[key]:.4E}")
    if "tflops-per-device" in metrics:
        parts.append(f"{metrics['tflops-per-device']:.3g} TFLOP/s/device")
    if "mfu" in metrics:
        parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
    for key in ("mem-max-allocated-bytes", "mem-rss-bytes"):
        if key in metrics:
            parts.append(f"{'max allocated' if 'allocated' in key else 'RSS'} {metrics[key] / 2**30:.2f} GiB")
    if "grad-norm" in metrics and math.isfinite(metrics["grad-norm"]):
        parts.append(f"grad norm {metrics['grad-norm']:.3f}")
    if metrics.get("loss-scale", 1.0) != 1.0:
        parts.append(f"loss scale {metrics['loss-scale']:.1f}")
    if metrics.get("skipped-iterations"):
        parts.append(f"skipped {int(metrics['skipped-iterations'])}")
    if metrics.get("nan-iterations"):
        parts.append(f"nan {int(metrics['nan-iterations'])}")
    parts.append(f"ETA {format_duration(eta_seconds)}")
    return " | ".join(parts)


def timers_line(timers: Mapping[str, float]) -> str:
    """e.g. `timers (ms/iteration, max across ranks): forward-backward 12.31 | optimizer 1.02`"""
    parts = [f"{name[: -len('-time')]} {seconds * 1000:.2f}" for name, seconds in timers.items()]
    return "timers (ms/iteration, max across ranks): " + " | ".join(parts)


def eval_line(step: int, split: str, metrics: Mapping[str, float]) -> str:
    """e.g. `validation at iteration 20 | lm loss 4.1E+00 | lm loss PPL 6.0E+01`"""
    parts = [f"{split} at iteration {step}"]
    for key, value in metrics.items():
        parts.append(f"{key} {value:.4E}")
        parts.append(f"{key} PPL {perplexity(value):.4E}")
    return " | ".join(parts)
