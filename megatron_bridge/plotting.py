"""Training curves of one or more runs side by side: loss (train and validation), learning rate
and throughput against iterations, one line per run (and per loss) in each panel.

Draws on a bare Agg canvas (no pyplot), so it changes no global matplotlib state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_bridge.extras import require
from megatron_bridge.training.loggers.readback import RunMetrics, Series


@dataclass(frozen=True)
class Curve:
    """A metric drawn in a panel: its name, legend suffix and line style."""

    metric: str
    suffix: str
    style: str = "-"


PANELS: tuple[tuple[str, tuple[Curve, ...]], ...] = (
    ("loss", (Curve("lm loss", "train"), Curve("lm loss validation", "validation", "--o"))),
    ("learning rate", (Curve("learning-rate", ""),)),
    ("throughput (tokens/s)", (Curve("tokens-per-second", ""),)),
)
PLOTTED = tuple(curve.metric for _, curves in PANELS for curve in curves)


@dataclass(frozen=True)
class Drawn:
    """One line of the figure."""

    run: str
    metric: str
    series: Series


def plot_runs(
    runs: Sequence[RunMetrics], output: str, size: tuple[int, int] = (1500, 450), dpi: int = 100
) -> dict[str, list[Drawn]]:
    """Draw `runs` into the image file `output` of `size` pixels (width, height); returns the lines
    drawn, by panel title."""
    require("matplotlib", "plotting training curves")
    from matplotlib import rcParams
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("no runs to plot")
    for run in runs:
        if not any(metric in run.series for metric in PLOTTED):
            have = ", ".join(sorted(run.series)) or "no metrics at all"
            raise ValueError(
                f"run {run.label!r} has none of the plotted metrics ({', '.join(PLOTTED)}); it has: {have}"
            )
    width, height = size
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PANELS))
    colors = [c["color"] for c in rcParams["axes.prop_cycle"]]
    drawn: dict[str, list[Drawn]] = {}
    for ax, (title, curves) in zip(axes, PANELS, strict=True):
        drawn[title] = []
        for index, run in enumerate(runs):
            for curve in curves:
                series = run.series.get(curve.metric)
                if series is None or not series.steps:
                    continue
                label = f"{run.label} {curve.suffix}".strip()
                ax.plot(
                    series.steps,
                    series.values,
                    curve.style,
                    color=colors[index % len(colors)],
                    label=label,
                    markersize=3,
                )
                drawn[title].append(Drawn(run.label, curve.metric, series))
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(True, alpha=0.3)
        if drawn[title]:
            ax.legend(fontsize="small")
    fig.savefig(output, dpi=dpi)
    return drawn
