"""Non-finite training: a step whose loss or gradients hold inf/NaN is caught before the optimizer
applies it, and weights that are no longer finite are never saved."""

from __future__ import annotations

import math

import torch


class NonFiniteStep(Exception):
    """The step's loss or gradients are not finite (raised on every rank alike)."""

    def __init__(self, what: str):
        super().__init__(f"non-finite {what}")
        self.what = what


def any_rank(flags: list[bool], device) -> list[bool]:
    import torch.distributed as dist

    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def _device(chunks):
    return next(p for c in chunks for p in c.parameters()).device


def check_step(chunks, reports: dict[str, tuple[float, float]], *, check_grads: bool) -> None:
    """Collective: raise NonFiniteStep on every rank when the loss (known on the last pipeline stage)
    or, with ``check_grads``, any rank's reduced gradients are not finite. fp16 runs leave the
    gradients to the loss scaler, which skips overflowing steps itself."""
    bad_loss = any(not math.isfinite(s) for s, _ in reports.values())
    bad_grads = False
    if check_grads:
        buffers = [b for c in chunks for b in (c.buffers + c.expert_parallel_buffers)]
        bad_grads = bool(buffers) and not bool(torch.stack([torch.isfinite(b.grad_data).all() for b in buffers]).all())
    bad_loss, bad_grads = any_rank([bad_loss, bad_grads], _device(chunks))
    if bad_loss or bad_grads:
        raise NonFiniteStep("loss" if bad_loss else "gradients")


def tensors_finite(tensors) -> bool:
    """Whether every value of the floating-point CPU ``tensors`` is finite: none has all its
    exponent bits set (inf, NaN). Read with numpy, no torch kernel: a forked checkpoint writer runs
    it, and torch's OpenMP threads do not survive a fork (a parallel kernel there hangs)."""
    import numpy as np

    for t in tensors:
        bits = _EXPONENT_BITS.get(t.dtype)
        if bits is None or not t.numel():
            continue
        as_int, exponent = bits
        values = t.detach().view(as_int).numpy()
        if np.any((values & exponent) == exponent):
            return False
    return True


_EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.bfloat16: (torch.int16, 0x7F80),
                  torch.float16: (torch.int16, 0x7C00), torch.float64: (torch.int64, 0x7FF0000000000000)}


class NonFiniteSave(Exception):
    """The state a save wrote is not finite (raised on every rank alike); it was not published."""

    def __init__(self, iteration: int):
        super().__init__(f"the weights are not finite after iteration {iteration} (not saved)")
        self.iteration = iteration


def stopped(what: str, last_good, on_nonfinite: str):
    """The error that ends a run on non-finite training, naming the newest good checkpoint."""
    from megacli.errors import UserError

    good = f"the last good checkpoint is {last_good}" if last_good else "no good checkpoint was saved"
    skip = " (train.on_nonfinite = skip drops such steps instead)" if on_nonfinite == "stop" else ""
    return UserError(f"training stopped: {what}; {good}. Lower optim.lr or check the data{skip}")
