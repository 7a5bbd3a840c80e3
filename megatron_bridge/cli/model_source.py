"""The model-source argument and options `mbridge generate` and `mbridge eval` share, and the
errors of theirs that are the user's to fix (reported without a traceback, exit status 2)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from typing import Iterator

from megatron_bridge.inference.model import BACKENDS
from megatron_bridge.cli.errors import UsageError
from megatron_bridge.inference.errors import DataError, PromptError, SourceError
from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.runtime.launcher_env import launcher_int

SOURCE_HELP = (
    "a Hugging Face model directory (with config.json), or a checkpoint directory of ours: a save directory "
    "(its latest iteration) or one iter_N directory; a LoRA/DoRA checkpoint is loaded on the base its run recorded"
)


def add_source_arguments(p: argparse.ArgumentParser, batch_size: int) -> None:
    p.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint iteration to load (default: the latest)")
    p.add_argument("--base", metavar="DIR", help="base model of a LoRA/DoRA checkpoint (default: the one its run recorded)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory or tokenizer.json (default: the source's)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="weights dtype (default: the dtype they are stored in)")
    p.add_argument("--tp", type=int, metavar="N", help="tensor-parallel size (default: the number of processes under torchrun)")
    p.add_argument(
        "--backend", choices=BACKENDS, default="auto",
        help="process-group backend: nccl runs on the GPUs (one process per GPU), gloo on the CPU; auto: nccl where "
        "GPUs are visible, else gloo (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=batch_size, metavar="N", help="sequences run together (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="machine-readable output (see the command's description)")


def load_options(args: argparse.Namespace) -> dict:
    return dict(step=args.step, base=args.base, tokenizer=args.tokenizer, tp=args.tp, dtype=args.dtype, backend=args.backend)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A bad source, prompt, data file or option becomes a `UsageError`; anything else keeps
    its traceback (it is a bug)."""
    try:
        yield
    except ConfigValidationError as exc:  # the Python API's argument names, said as the command's options
        named = [dataclasses.replace(p, path=_OPTIONS.get(p.path, p.path)) for p in exc.problems]
        raise UsageError(str(ConfigValidationError(named))) from exc
    except (SourceError, PromptError, DataError) as exc:
        raise UsageError(str(exc)) from exc


_OPTIONS = {
    name: "--" + name.replace("_", "-")
    for name in ("max_new_tokens", "batch_size", "temperature", "top_k", "top_p", "seed", "stop", "backend", "seq_length")
} | {"data_format": "--format", "prompts": "--prompt"}
"""The options of `mbridge generate|eval` by the argument name of `generate()`/`evaluate()` a
problem names."""


def prints() -> bool:
    """Whether this process writes the results (the first rank under torchrun)."""
    return launcher_int("RANK", 0) == 0
