"""Checksums of tensors, bytes and pickled objects, for comparing a reshard's output with its source."""

from __future__ import annotations

import hashlib
import pickle

import torch


class Digest:
    """A running checksum over tensors (dtype, shape and bytes of each, in order)."""

    def __init__(self):
        self._h = hashlib.blake2b(digest_size=16)

    def update(self, t: torch.Tensor) -> None:
        self._h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            self._h.update(flat.view(torch.uint8).numpy().tobytes() if flat.dtype != torch.bool else flat.numpy().tobytes())

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """A checksum of a tensor's dtype, shape and bytes."""
    d = Digest()
    d.update(t)
    return d.hexdigest()


def bytes_digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def object_digest(obj) -> str:
    """A checksum of a (nested) Python object with tensors, independent of how it was pickled."""
    h = hashlib.blake2b(digest_size=16)

    def feed(x):
        if isinstance(x, torch.Tensor):
            h.update(b"T")
            h.update(tensor_digest(x).encode())
        elif isinstance(x, dict):
            h.update(b"D%d" % len(x))
            for k in sorted(x, key=repr):
                feed(k)
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(b"L%d" % len(x) if isinstance(x, list) else b"U%d" % len(x))
            for v in x:
                feed(v)
        else:
            try:
                import numpy as np

                if isinstance(x, np.ndarray):
                    h.update(b"A" + str(x.dtype).encode() + repr(x.shape).encode() + x.tobytes())
                    return
            except ImportError:
                pass
            h.update(b"S" + pickle.dumps(x, protocol=4) if not isinstance(x, (int, float, str, bool, type(None))) else
                     b"P" + repr(x).encode())

    feed(obj)
    return h.hexdigest()
