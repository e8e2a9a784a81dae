"""Stopping a run at a step boundary, with a checkpoint: on SIGTERM or SIGUSR1 (what Slurm sends
before preemption or the time limit) when checkpoint.save_on_signal is on, or at
train.time_limit_minutes. Saving is collective, so every rank must stop after the same step: the
decision is all-reduced once per step.

One stop request per job: schedulers signal every process of a job (the launcher and its workers)
and the launcher passes its signal on, so a worker gets copies of one request. Copies that arrive
within REPEAT_WINDOW_S of the first are that request; a signal after it (a person insisting) stops
the process at once. A worker that cannot reach a step boundary (stuck in data loading, say) gives
up after a bounded wait, saying that nothing could be saved."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
REPEAT_WINDOW_S = 5.0
MIN_BOUNDARY_WAIT_S = 60.0
SLOWEST_INTERVAL_FACTOR = 3  # a step boundary is expected within this many of the slowest intervals between two


class StopRequests:
    """``max_wait_s``: at most this long from a signal to the next step boundary (the launcher kills
    a worker later than that). ``give_up(signal, waited_s)`` runs, in another thread, when the wait
    is over; by default it records the error for the launcher and exits the process. ``saves``:
    the run saves checkpoints (see shield_checkpoint_writer)."""

    def __init__(self, *, save_on_signal: bool, time_limit_minutes: float | None, device, max_wait_s: float,
                 run_dir: str | None = None, give_up=None, saves: bool = False):
        self.device = device
        self.time_limit_minutes = time_limit_minutes
        self.deadline = time.monotonic() + time_limit_minutes * 60 if time_limit_minutes else None
        self.received: signal.Signals | None = None
        self.received_at = 0.0
        self.max_wait_s = max_wait_s
        self.last_boundary = time.monotonic()
        self.slowest_interval = 0.0  # between two step boundaries (a step, an evaluation, a save)
        self.reached = threading.Event()  # the stop was decided at a step boundary, or the run ended
        self.give_up = give_up or (lambda sig, waited: exit_unsaved(sig, waited, run_dir))
        # Python takes signal handlers only in the main thread (a run driven from another thread has none).
        handles = save_on_signal and threading.current_thread() is threading.main_thread()
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS} if handles else {}
        if handles:
            _children_ignore_stop_signals(True)
        if saves:
            shield_checkpoint_writer()

    def boundary_wait_s(self) -> float:
        return min(self.max_wait_s, max(MIN_BOUNDARY_WAIT_S, SLOWEST_INTERVAL_FACTOR * self.slowest_interval))

    def _on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if self.received is not None:
            if now - self.received_at < REPEAT_WINDOW_S:
                return  # a copy of the same request
            signal.signal(signum, signal.SIG_DFL)  # insisted on: stop now, as without a handler
            os.kill(os.getpid(), signum)
            return
        self.received, self.received_at = signal.Signals(signum), now
        wait = self.boundary_wait_s()
        threading.Thread(target=self._watch, args=(self.received, wait), daemon=True, name="megacli-stop-watch").start()

    def _watch(self, sig: signal.Signals, wait: float) -> None:
        if not self.reached.wait(wait):
            self.give_up(sig, wait)

    def reason(self) -> str | None:
        """Why every rank stops after this step, or None (collective: call it on every rank)."""
        now = time.monotonic()
        self.slowest_interval = max(self.slowest_interval, now - self.last_boundary)
        self.last_boundary = now
        if not self.previous and self.deadline is None:
            return None
        import torch

        code = 0
        if self.received is not None:
            code = STOP_SIGNALS.index(self.received) + 1
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            code = len(STOP_SIGNALS) + 1
        flag = torch.tensor([code], dtype=torch.int32, device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        code = int(flag.item())
        if code == 0:
            return None
        self.reached.set()
        if code <= len(STOP_SIGNALS):
            return STOP_SIGNALS[code - 1].name
        return f"the time limit (train.time_limit_minutes = {self.time_limit_minutes:g})"

    def close(self) -> None:
        self.reached.set()
        if self.previous:
            _children_ignore_stop_signals(False)
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


_writer_manager = None  # kept alive: its process serves the checkpoint writer's results queue


def shield_checkpoint_writer() -> None:
    """Megatron-Core's checkpoint writer reports through a queue served by a process it spawns, with
    default signal handlers. A scheduler signals every process of a job (Slurm's scancel, its
    --signal): that process would die and take the save at the step boundary with it. Start it here
    with the stop signals blocked, dying with this process, its items pickled on this side
    (PickledItems): every run that saves gets it, whether or not it handles stop signals."""
    global _writer_manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megacli.lifetime import quiet_helper

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=quiet_helper, initargs=STOP_SIGNALS)
    filesystem_async._results_queue = PickledItems(manager.Queue())
    _writer_manager = manager


class PickledItems:
    """The writer's results queue, its items pickled and unpickled on this side: the process serving
    the queue holds bytes and never unpickles a result (which would import torch there, seconds of
    CPU at a process's first save, and slow its exit). Megatron-Core puts and takes without waiting."""

    def __init__(self, queue):
        self.queue = queue

    def put(self, item) -> None:
        self.queue.put(pickle.dumps(item))

    def get_nowait(self):
        return pickle.loads(self.queue.get_nowait())


_ignored_in_children = False
_hook_registered = False


def _ignore_stop_signals() -> None:
    if _ignored_in_children:
        for sig in STOP_SIGNALS:
            try:
                signal.signal(sig, signal.SIG_IGN)
            except ValueError:  # not the child's main thread: it keeps the inherited handler
                pass


def _children_ignore_stop_signals(on: bool) -> None:
    """While a run handles stop requests, the processes it forks (Megatron-Core's checkpoint
    writers) ignore the stop signals: a job's signal reaches every process, and a writer must not
    stop mid-write (nor run the run's handler); the run waits for it, and it dies with the run."""
    global _ignored_in_children, _hook_registered
    _ignored_in_children = on
    if on and not _hook_registered:
        os.register_at_fork(after_in_child=_ignore_stop_signals)
        _hook_registered = True


def exit_unsaved(sig: signal.Signals, waited_s: float, run_dir: str | None) -> None:
    """End this worker: no step boundary came within ``waited_s`` of ``sig``. The error is
    recorded for the launcher (said here when there is none) and the process exits at once: its
    main thread is stuck."""
    from megacli.errors import UserError
    from megacli.rundir import record_worker_error
    from megacli.lifetime import LAUNCHER_PID_VAR

    err = UserError(f"stopped on {sig.name}: no step boundary was reached within {waited_s:.0f} s of the signal "
                    f"(the run is stuck, e.g. reading data): nothing could be saved")
    err.exit_code = 128 + int(sig)
    try:
        if run_dir is not None:
            record_worker_error(run_dir, err, "")
        if not os.environ.get(LAUNCHER_PID_VAR):
            print(f"error: {err}", file=sys.stderr, flush=True)
    finally:
        os._exit(err.exit_code)


def record_stop(*, run_dir: str, rank: int, reason: str, iteration: int, checkpoint) -> None:
    """Tell the launcher (rank 0 only) that the workers stopped at a step boundary."""
    if rank != 0:
        return
    import json
    from pathlib import Path

    from megacli.rundir import STOPPED_FILE

    record = {"reason": reason, "iteration": iteration, "checkpoint": str(checkpoint) if checkpoint else None}
    (Path(run_dir) / STOPPED_FILE).write_text(json.dumps(record) + "\n")
