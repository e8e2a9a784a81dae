"""Prefix caching for megacli serve: the keys and values of a prompt's leading tokens, kept in
blocks of ``block`` tokens after a prefill, are copied into the next sequence that starts with the
same tokens instead of being computed again.

A block is known by a hash of its tokens and of the hash of the block before it, so a block is
reused only after the same whole prefix. Keys are cached already rotated by their positions
(``kv_cache.CachedRotarySelfAttention``), which are the same for every sequence that starts with
this prefix. The least recently used blocks are evicted beyond ``max_blocks``. Every rank keeps the
blocks of its own layers and heads and makes the same choices, since it runs the same calls.
"""

from __future__ import annotations

import collections
import hashlib

import torch


def block_hashes(ids: list[int], block: int) -> list[bytes]:
    """The hash of each whole block of ``ids`` and of everything before it."""
    out, previous = [], b""
    for start in range(0, len(ids) - block + 1, block):
        data = previous + torch.tensor(ids[start : start + block], dtype=torch.int64).numpy().tobytes()
        previous = hashlib.blake2b(data, digest_size=16).digest()
        out.append(previous)
    return out


class PrefixCache:
    """Blocks of cached keys and values, by prefix hash; ``hit_tokens`` (kept by the caller) counts
    the prompt tokens they spared."""

    def __init__(self, *, block: int, max_blocks: int):
        self.block, self.max_blocks = block, max_blocks
        self.blocks: collections.OrderedDict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = collections.OrderedDict()
        self.hit_tokens = 0

    def reusable(self, ids: list[int]) -> list[bytes]:
        """The hashes of the leading blocks of ``ids`` that are cached (never the last token, whose
        logits the prefill must compute)."""
        found = []
        for h in block_hashes(ids[:-1], self.block):
            if h not in self.blocks:
                break
            found.append(h)
        return found

    def load(self, hashes: list[bytes], memory: list[tuple[torch.Tensor, torch.Tensor]], slot: int, first: int) -> None:
        """Copy the blocks into ``slot``'s columns from ``first`` on (memory: each layer's [cols, batch, ...])."""
        with torch.inference_mode():
            for i, h in enumerate(hashes):
                self.blocks.move_to_end(h)
                cols = slice(first + i * self.block, first + (i + 1) * self.block)
                for (keys, values), (k, v) in zip(memory, self.blocks[h]):
                    keys[cols, slot] = k
                    values[cols, slot] = v

    def store(self, ids: list[int], memory: list[tuple[torch.Tensor, torch.Tensor]], slot: int, first: int) -> None:
        """Keep the whole blocks of ``ids``, prefilled into ``slot`` from column ``first``."""
        with torch.inference_mode():
            for i, h in enumerate(block_hashes(ids, self.block)):
                if h in self.blocks:
                    self.blocks.move_to_end(h)
                    continue
                cols = slice(first + i * self.block, first + (i + 1) * self.block)
                self.blocks[h] = [(keys[cols, slot].clone(), values[cols, slot].clone()) for keys, values in memory]
                if len(self.blocks) > self.max_blocks:
                    self.blocks.popitem(last=False)
