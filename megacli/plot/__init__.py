"""Plots of runs from their metrics.jsonl: the curves (series), a matplotlib figure written as PNG
or self-contained HTML (figure), and the loss curve as text for a terminal (text)."""
