"""Errors meant for people. The CLI prints these as one message (no traceback) and exits non-zero."""


class UserError(Exception):
    """Bad input found at run time (a missing file, a vocabulary that does not match the data, ...).
    The message should name the thing, the value and the fix."""

    exit_code = 2


LONGEST_LINE = 1000  # characters of one message line shown
MOST_LINES = 200  # lines of one message shown


def readable(message: str) -> str:
    """``message`` cut to a readable length, the one rule for every message megacli prints: a line
    longer than LONGEST_LINE keeps its start and its end (where the cause and the fix are) around a
    note of what was left out; past MOST_LINES lines, the first and last half of them."""
    lines = message.splitlines() or [""]
    if len(lines) > MOST_LINES:
        half = MOST_LINES // 2
        lines = [*lines[:half], f"... ({len(lines) - MOST_LINES} more lines) ...", *lines[-half:]]
    return "\n".join(_shortened(line) for line in lines)


def _shortened(line: str) -> str:
    if len(line) <= LONGEST_LINE:
        return line
    head, tail = LONGEST_LINE * 3 // 5, LONGEST_LINE * 2 // 5
    return f"{line[:head]} ... ({len(line) - head - tail} characters left out) ... {line[-tail:]}"
