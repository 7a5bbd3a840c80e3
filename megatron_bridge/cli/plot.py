"""`mbridge plot`: training curves of runs, from TensorBoard event files or MLflow."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from megatron_bridge.cli.errors import UsageError

EPILOG = """\
examples:
  mbridge plot runs/a/tb                                  one run (event files searched recursively)
  mbridge plot runs/a/tb runs/b/tb -o compare.png         two runs side by side
  mbridge plot --mlflow-uri sqlite:///mlflow.db --run run-a --run run-b
  mbridge plot --mlflow-uri ./mlruns --run run-a runs/b/tb"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plot",
        help="plot loss, learning rate and throughput of runs",
        description="Draw loss (train and validation), learning rate and throughput against iterations "
        "for one or more runs, one line per run in each panel (needs the 'plot' extra).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "run_dirs", nargs="*", metavar="RUN_DIR", help="a directory with TensorBoard event files (searched recursively)"
    )
    p.add_argument(
        "--mlflow-uri",
        metavar="URI",
        help="MLflow tracking URI (sqlite:///mlflow.db, http://...) or an mlruns directory",
    )
    p.add_argument(
        "--run", action="append", default=[], metavar="NAME", help="an MLflow run name or id (repeat for several)"
    )
    p.add_argument("--experiment", metavar="NAME", help="the MLflow experiment to look for --run in (default: all)")
    p.add_argument(
        "-o",
        "--output",
        default="training_curves.png",
        metavar="FILE",
        help="image file to write (default: %(default)s)",
    )
    p.add_argument("--size", default="1500x450", metavar="WxH", help="image size in pixels (default: %(default)s)")
    p.set_defaults(handler=run)


def parse_size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match or int(match.group(1)) < 100 or int(match.group(2)) < 100:
        raise UsageError(f"--size {text!r}: expected WIDTHxHEIGHT in pixels, each at least 100 (e.g. 1500x450)")
    return int(match.group(1)), int(match.group(2))


def short_labels(paths: list[str]) -> list[str]:
    """The fewest trailing path components that tell the runs apart (`a/tb`, `b/tb`; `run1`, `run2`)."""
    parts = [os.path.normpath(p).split(os.sep) for p in paths]
    for n in range(1, max((len(p) for p in parts), default=1) + 1):
        labels = [os.sep.join(p[-n:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [os.path.normpath(p) for p in paths]


def mlflow_uri(uri: str) -> str:
    """A directory (an `mlruns` folder) as a file: URI; anything else as given."""
    if "://" not in uri and os.path.isdir(uri):
        uri = "file://" + os.path.abspath(uri)
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses file stores otherwise
    return uri


def run(args: argparse.Namespace) -> int:
    from megatron_bridge.plotting import plot_runs
    from megatron_bridge.training.loggers.readback import read_mlflow, read_tensorboard

    if not args.run_dirs and not args.run:
        raise UsageError(
            "nothing to plot: give RUN_DIR(s) with TensorBoard event files, or --mlflow-uri URI --run NAME"
        )
    if args.run and not args.mlflow_uri:
        raise UsageError("--run needs --mlflow-uri (e.g. sqlite:///mlflow.db, or the path of an mlruns directory)")
    size = parse_size(args.size)
    if os.path.isdir(args.output):
        raise UsageError(
            f"--output {args.output!r} is a directory; give the image file to write, e.g. "
            f"{os.path.join(args.output, 'training_curves.png')}"
        )
    folder = os.path.dirname(args.output)
    if folder and not os.path.isdir(folder):
        raise UsageError(f"--output {args.output!r}: its directory {folder!r} does not exist (create it, or write the image elsewhere)")
    if not os.path.splitext(args.output)[1]:
        args.output += ".png"  # what the image writer does with a name without a suffix; the message says so
    try:
        runs = [read_tensorboard(d, label) for d, label in zip(args.run_dirs, short_labels(args.run_dirs), strict=True)]
        if args.run:
            uri = mlflow_uri(args.mlflow_uri)
            runs += [read_mlflow(uri, name, args.experiment) for name in args.run]
        drawn = plot_runs(runs, args.output, size=size)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as exc:
        raise UsageError(str(exc)) from exc
    lines = ", ".join(f"{title}: {len(items)} line{'s' if len(items) != 1 else ''}" for title, items in drawn.items())
    print(f"wrote {args.output} ({size[0]}x{size[1]} px; {lines})")
    return 0
