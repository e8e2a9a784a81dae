"""Rank 0 drives, every rank of a TP/PP layout computes: ``Lockstep`` broadcasts each of rank 0's
calls (a method name of a worker object and its arguments); the other ranks ``follow``, running
the same calls on their own worker in the same order."""

from __future__ import annotations


class Lockstep:
    """Rank 0 broadcasts each call (a method of ``work`` and its arguments); every rank runs it."""

    def __init__(self, work, *, world_size: int):
        self.work, self.world_size = work, world_size

    def _send(self, message) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.broadcast_object_list([message], src=0)

    def call(self, name: str, *args, **kwargs):
        self._send((name, args, kwargs))
        return getattr(self.work, name)(*args, **kwargs)

    def ask(self, name: str, *args):
        """Rank 0's own worker answers a question (a method that changes nothing): no broadcast."""
        return getattr(self.work, name)(*args)

    def stop(self) -> None:
        self._send(None)

    def follow(self) -> None:
        """The other ranks: run rank 0's calls until it stops."""
        import torch.distributed as dist

        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            name, args, kwargs = box[0]
            getattr(self.work, name)(*args, **kwargs)
