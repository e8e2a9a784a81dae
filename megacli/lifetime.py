"""Processes that die with their parent: a worker with its launcher, and the helper processes a
worker starts (Megatron's checkpoint writers) with the worker, so a `kill -9` of the launcher
leaves nothing running. Linux (prctl PR_SET_PDEATHSIG); elsewhere nothing is done. And how a
megacli process ends once its command is over (exit_now)."""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1
LAUNCHER_PID_VAR = "MEGACLI_LAUNCHER_PID"


def die_with_parent(expected_parent: int | None = None) -> None:
    """SIGKILL this process when its parent exits. ``expected_parent``: exit now if the parent is
    already gone (the request only covers a parent alive when it is made)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


_forking_pid: int | None = None  # the pid of a process about to fork, as its child sees it


def _note_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _child_dies_with_parent() -> None:
    # The parent may be gone before the child gets here (killed right after fork): exit then.
    die_with_parent(_forking_pid)


def worker_dies_with_launcher() -> None:
    """For a worker: die with the launcher, and make every process it forks die with it."""
    launcher = os.environ.get(LAUNCHER_PID_VAR)
    die_with_parent(int(launcher) if launcher else None)
    os.register_at_fork(before=_note_forking_pid, after_in_child=_child_dies_with_parent)


def quiet_helper(*blocked: signal.Signals) -> None:
    """For a helper process a worker starts: it dies with the worker, and the ``blocked`` signals
    (the stop requests a scheduler sends every process of a job) stay pending instead of ending it."""
    die_with_parent()
    signal.pthread_sigmask(signal.SIG_BLOCK, blocked)


def exit_now(code: int):
    """End this process with ``code``: what a normal exit does up to its exit handlers (other
    threads joined, atexit handlers run, output flushed), without the interpreter's teardown of
    every module and object after them (1-2 s in a process that imported torch and Megatron-Core;
    nothing is written there)."""
    import atexit
    import threading

    threading._shutdown()  # as Python's exit: wait for the non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more to say
            pass
    os._exit(code)
