"""A curve drawn with characters, for a terminal without a display (`megacli plot --ascii`)."""

from __future__ import annotations

from megacli.plot.series import Run

MARKS = "*+ox#@%&"
LABEL_WIDTH = 10


def text_chart(runs: list[Run], metric: str = "loss", width: int = 72, height: int = 18) -> str:
    """``metric`` of every run on one character grid (run i drawn with MARKS[i]): the y axis
    labelled with the highest, middle and lowest value, the x axis with the first and last iteration."""
    curves = [(MARKS[i % len(MARKS)], run.label, run.curves[metric]) for i, run in enumerate(runs) if metric in run.curves]
    points = [(x, y) for _, _, c in curves for x, y in zip(c.iterations, c.values) if y == y]  # y == y: not nan
    if not points:
        return f"(no {metric} values to draw)"
    x_lo, x_hi = min(x for x, _ in points), max(x for x, _ in points)
    y_lo, y_hi = min(y for _, y in points), max(y for _, y in points)
    grid = [[" "] * width for _ in range(height)]
    for mark, _, curve in curves:
        previous = None
        for x, y in zip(curve.iterations, curve.values):
            if y != y:
                continue
            column = round((x - x_lo) / (x_hi - x_lo) * (width - 1)) if x_hi > x_lo else 0
            row = round((y_hi - y) / (y_hi - y_lo) * (height - 1)) if y_hi > y_lo else height // 2
            if previous is not None:  # join to the previous point, one mark per column between
                last_column, last_row = previous
                for between in range(last_column + 1, column):
                    grid[round(last_row + (row - last_row) * (between - last_column) / (column - last_column))][between] = mark
            grid[row][column] = mark
            previous = column, row
    labels = {0: y_hi, (height - 1) // 2: (y_hi + y_lo) / 2, height - 1: y_lo}
    lines = [f"{metric}"]
    for row, cells in enumerate(grid):
        label = f"{labels[row]:.4g}" if row in labels else ""
        lines.append(f"{label:>{LABEL_WIDTH}} |{''.join(cells)}")
    lines.append(" " * LABEL_WIDTH + " +" + "-" * width)
    left, right = str(x_lo), str(x_hi)
    lines.append(" " * (LABEL_WIDTH + 2) + left + right.rjust(width - len(left)) + "  iteration")
    lines.extend(f"  {mark} {label}" for mark, label, _ in curves)
    return "\n".join(lines)
