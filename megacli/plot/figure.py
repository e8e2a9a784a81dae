"""The runs' curves as a matplotlib figure, one panel per metric, written as a PNG or as an HTML
page with the figure inline as SVG (nothing fetched from elsewhere). Uses matplotlib's object API
with the Agg canvas, so no display or global backend is involved."""

from __future__ import annotations

import math
import os
from html import escape
from pathlib import Path

from megacli.plot.series import Run, choose_metrics, read_runs

FORMATS = (".png", ".html")
PLOT_FILE = "plot.png"


def build_figure(runs: list[Run], metrics: list[str]):
    """One panel per metric, every run overlaid in its own colour. Evaluation curves are drawn with
    a marker at each evaluation; the loss panel marks the validation losses too."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    columns = 1 if len(metrics) == 1 else 2
    rows = math.ceil(len(metrics) / columns)
    figure = Figure(figsize=(6.4 * columns, 3.4 * rows), layout="constrained")
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, metric in zip(axes, metrics):
        ax.set_title(metric)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        for run, colour in zip(runs, colours):
            curve = run.curves.get(metric)
            if curve is not None:
                ax.plot(curve.iterations, curve.values, color=colour, label=run.label,
                        marker="o" if curve.evaluation else None, markersize=4)
            validation = run.curves.get("val_loss")
            if metric == "loss" and validation is not None:
                ax.plot(validation.iterations, validation.values, color=colour, linestyle="none", marker="o",
                        markerfacecolor="none", label=f"{run.label} validation")
        if len(runs) > 1 or metric == "loss" and any("val_loss" in r.curves for r in runs):
            ax.legend(fontsize="small")
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    return figure


def _html(figure, title: str) -> str:
    import io

    svg = io.StringIO()
    figure.savefig(svg, format="svg")
    body = svg.getvalue()
    body = body[body.index("<svg"):]  # drop the XML prolog and DOCTYPE: inline SVG needs neither
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{escape(title)}</title></head>\n"
            f"<body>\n<h1>{escape(title)}</h1>\n{body}\n</body></html>\n")


def write_figure(figure, path: Path, title: str) -> None:
    """Write atomically (a temporary file renamed into place): a reader never sees half a plot."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if path.suffix.lower() == ".html":
            tmp.write_text(_html(figure, title))
        else:
            figure.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_run_plot(run_dir: Path) -> None:
    """<run_dir>/plot.png of the default metrics (written during training)."""
    runs = read_runs([run_dir])
    write_figure(build_figure(runs, choose_metrics(runs, None)), run_dir / PLOT_FILE, title=runs[0].label)
