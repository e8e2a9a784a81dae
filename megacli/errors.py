"""Errors meant for people. The CLI prints these as one message (no traceback) and exits non-zero."""


class UserError(Exception):
    """Bad input found at run time (a missing file, a vocabulary that does not match the data, ...).
    The message should name the thing, the value and the fix."""

    exit_code = 2
