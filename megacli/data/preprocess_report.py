"""What a preprocessing run shows: the progress bar while it runs and the closing summary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

MB = 1024 * 1024


@dataclass
class Stats:
    """What a run counted."""

    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    bytes_in: int = 0
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)


@dataclass
class Result:
    """What a run wrote."""

    outputs: dict[str, str]
    stats: Stats
    seconds: float
    bytes_out: int
    dtype: np.dtype
    notes: list[str]
    tokenizer: str = ""
    encoder: str = ""  # which code turned text into ids (gigatoken, or the tokenizer's own library)


class ProgressBar:
    """A rich progress bar over input bytes: documents, MB/s, tokens/s, ETA."""

    def __init__(self, console, total_bytes: int, enabled: bool) -> None:
        self.console, self.total, self.enabled = console, total_bytes, enabled
        self.start = time.perf_counter()
        self._bar = None

    def __enter__(self) -> "ProgressBar":
        if self.enabled:
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]preprocess[/]"), BarColumn(), TaskProgressColumn(),
                TextColumn("{task.fields[docs]} docs · {task.fields[mbs]} MB/s · {task.fields[tps]} tok/s"),
                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=True,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("preprocess", total=self.total or None, docs=0, mbs="-", tps="-")
        return self

    def update(self, nbytes: int, stats: Stats) -> None:
        if self._bar is None:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self._bar.update(self._task, advance=nbytes, docs=f"{stats.documents:,}",
                         mbs=f"{stats.bytes_in / MB / elapsed:.1f}", tps=_si(stats.tokens / elapsed))

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=nbytes)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def summary_table(result: Result):
    """The closing summary as a rich Table."""
    from rich.table import Table

    s = result.stats
    secs = max(result.seconds, 1e-9)
    table = Table(title="preprocess summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("tokenizer", result.tokenizer)
    table.add_row("encoder", result.encoder)
    table.add_row("documents", f"{s.documents:,}")
    if s.sequences != s.documents:
        table.add_row("sequences", f"{s.sequences:,}")
    table.add_row("tokens", f"{s.tokens:,}")
    table.add_row("bytes in", f"{s.bytes_in:,} ({s.bytes_in / MB:.1f} MB)")
    table.add_row("bytes out", f"{result.bytes_out:,} ({result.bytes_out / MB:.1f} MB, {result.dtype.name})")
    table.add_row("seconds", f"{result.seconds:.2f}")
    table.add_row("throughput", f"{s.bytes_in / MB / secs:.2f} MB/s · {_si(s.tokens / secs)} tokens/s")
    if s.skipped:
        table.add_row("skipped bad records", f"{s.skipped:,}")
    for key, prefix in result.outputs.items():
        table.add_row(f"output ({key})", f"{prefix}.bin/.idx")
    return table
