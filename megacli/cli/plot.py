"""`megacli plot`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from megacli.cli.root import app
from megacli.cli.common import guarded

RunDirsArg = Annotated[List[Path], typer.Argument(metavar="RUN_DIR", help="Run directories (each with a metrics.jsonl); several are overlaid.",
                                                  show_default=False)]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the plot here: .png, or .html (self-contained). "
                                                   "Default plot.png, or nothing with --ascii.", show_default=False)]
MetricsOpt = Annotated[Optional[str], typer.Option("--metrics", help="Comma-separated metrics, one panel each "
                                                   "(default: those of loss,val_loss,lr,grad_norm,tokens_per_s,mfu the runs have).",
                                                   show_default=False)]
AsciiOpt = Annotated[bool, typer.Option("--ascii", help="Draw the loss curve in the console.")]


@app.command(help="Plot runs from their metrics.jsonl: one panel per metric, several runs overlaid, resumed segments "
                  "joined, evaluations marked; as PNG, self-contained HTML, or text (--ascii).")
@guarded
def plot(run_dirs: RunDirsArg, output: OutputOpt = None, metrics: MetricsOpt = None, ascii_: AsciiOpt = False) -> None:
    from megacli.errors import UserError
    from megacli.plot.figure import FORMATS
    from megacli.plot.series import choose_metrics, read_runs, skipped_note

    if output is None and not ascii_:
        output = Path("plot.png")
    if output is not None:
        if output.suffix.lower() not in FORMATS:
            raise UserError(f"--output {output}: unknown format {output.suffix or '(no extension)'!r} "
                            f"(use {' or '.join(FORMATS)})")
        if not output.parent.is_dir():
            raise UserError(f"--output {output}: directory {output.parent} does not exist")
    requested = [m.strip() for m in metrics.split(",") if m.strip()] if metrics is not None else None
    if requested == []:
        raise UserError("--metrics: name at least one metric")
    runs = read_runs(run_dirs)
    panels = choose_metrics(runs, requested)
    drawn = sorted({*panels, "loss"} if ascii_ else set(panels))
    for run in runs:
        note = skipped_note(run, drawn)
        if note:
            typer.echo(f"note: {note}", err=True)
    if ascii_:
        from megacli.plot.text import text_chart

        typer.echo(text_chart(runs, "loss"))
    if output is not None:
        _write(runs, panels, output)
        typer.echo(f"wrote {output}")


def _write(runs, panels, output: Path) -> None:
    from megacli.errors import UserError

    try:
        from megacli.plot.figure import build_figure, write_figure

        figure = build_figure(runs, panels)
    except ImportError as exc:
        raise UserError(f"--output {output}: drawing needs matplotlib ({exc}); pip install matplotlib, or use --ascii") from None
    write_figure(figure, output, title=", ".join(r.label for r in runs))
