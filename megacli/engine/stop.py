"""Stopping a run at a step boundary, with a checkpoint: on SIGTERM or SIGUSR1 (what Slurm sends
before preemption or the time limit) when checkpoint.save_on_signal is on, or at
train.time_limit_minutes. Saving is collective, so every rank must stop after the same step: the
decision is all-reduced once per step. A second signal stops the process at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    def __init__(self, *, save_on_signal: bool, time_limit_minutes: float | None, device):
        self.device = device
        self.time_limit_minutes = time_limit_minutes
        self.deadline = time.monotonic() + time_limit_minutes * 60 if time_limit_minutes else None
        self.received: signal.Signals | None = None
        # Python takes signal handlers only in the main thread (a run driven from another thread has none).
        handles = save_on_signal and threading.current_thread() is threading.main_thread()
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS} if handles else {}

    def _on_signal(self, signum, frame) -> None:
        if self.received is not None:  # the second signal: stop now, as without a handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signal.Signals(signum)

    def reason(self) -> str | None:
        """Why every rank stops after this step, or None (collective: call it on every rank)."""
        if not self.previous and self.deadline is None:
            return None
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
        if code <= len(STOP_SIGNALS):
            return STOP_SIGNALS[code - 1].name
        return f"the time limit (train.time_limit_minutes = {self.time_limit_minutes:g})"

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
