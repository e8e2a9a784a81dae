"""A KV cache of independent sequences for continuous batching: ``Slots`` holds up to
``max_batch`` sequences of different lengths, each in its own row (slot) of Megatron-Core's static
KV cache, and steps all of them one token at a time.

Every decoding step writes one cache column, ``clock``, for every busy slot. A sequence that joins
has its prompt prefilled into its row at the columns just before the clock, so its tokens are
contiguous columns; the columns before them (an earlier occupant's, or nobody's) are masked. Keys
are rotated by each sequence's own positions (``DecodeContext.rope_positions``; learned position
embeddings take the same positions), so a sequence computes as it would alone, whatever column it
starts at, and the columns can be shifted: left when the clock reaches the end of the cache (every
sequence keeps its tokens), right when a prompt longer than the clock joins.

Every rank of a TP/PP layout runs the same calls (``lockstep.Lockstep``), so ``admit``, ``step``
and ``release`` must be called in the same order with the same arguments everywhere.
"""

from __future__ import annotations

import torch

from megacli.errors import UserError
from megacli.inference.serve.prefix_cache import PrefixCache


def check_servable(model) -> None:
    """A UserError unless every self-attention of the model is the cached-rotary one without
    sliding windows and with plain RoPE (or none): what per-sequence positions rely on."""
    from megatron.core.transformer.attention import SelfAttention, _yarn_get_concentration_factor_from_config

    from megacli.engine.models.kv_cache import CachedRotarySelfAttention

    c = model.config
    if c.flash_decode or c.rotary_interleaved or _yarn_get_concentration_factor_from_config(c) != 1.0:
        raise UserError("megacli serve runs models with plain RoPE, learned positions or ALiBi; this model's "
                        "RoPE variant (YaRN, interleaved) is not supported: use `megacli generate`")
    for module in model.net.modules():
        if isinstance(module, SelfAttention):
            if type(module) is not CachedRotarySelfAttention:
                raise UserError(f"megacli serve does not run {type(module).__name__} attention (e.g. multi-latent "
                                f"attention): use `megacli generate`")
            if module.window is not None:
                raise UserError("megacli serve does not run sliding-window attention yet: use `megacli generate`")


class Slots:
    """``max_batch`` cache rows of ``capacity`` columns over a ``runner.Model``."""

    def __init__(self, model, *, max_batch: int, capacity: int, prefix: PrefixCache | None = None):
        from megacli.engine.models.kv_cache import DecodeContext

        self.model, self.max_batch, self.capacity = model, max_batch, capacity
        self.prefix = None  # not for the first forward below
        self.context = DecodeContext(max_batch, capacity)
        self.start: list[int | None] = [None] * max_batch  # first column of each busy slot's tokens
        self.length = [0] * max_batch  # tokens in the cache per slot (= the next token's position)
        self.clock = 0  # the column the next step writes
        self.shifts = 0  # times the cached columns were moved
        # Megatron allocates the cache (uninitialised) at the first forward: one token through it,
        # then zeros, so that masked columns never hold NaN (0 x NaN would reach the outputs)
        self.admit(0, [0])
        self.release(0)
        with torch.inference_mode():  # the cache is made of inference tensors
            for keys, values in self.context.key_value_memory_dict.values():
                keys.zero_()
                values.zero_()
        self.prefix = prefix

    def busy(self) -> list[int]:
        return [s for s, start in enumerate(self.start) if start is not None]

    def admit(self, slot: int, ids: list[int], *, all_logits: bool = False) -> torch.Tensor:
        """Prefill ``ids`` into free ``slot``: next-token logits [vocab] (all_logits: [len(ids), vocab],
        the logits after every prompt token)."""
        assert self.start[slot] is None, f"slot {slot} is busy"
        n = len(ids)
        if not self.busy():
            self.clock = n
        elif self.clock < n:
            self._shift(n - self.clock)
        first = self.clock - n
        reused = self.prefix.reusable(ids) if self.prefix is not None and not all_logits else []
        if reused:
            self.prefix.load(reused, self._memory(), slot, first)
        cached = len(reused) * self.prefix.block if reused else 0  # tokens not computed again
        dev = self.model.device
        tokens = torch.tensor([ids[cached:]], device=dev)
        positions = torch.arange(cached, n, device=dev)[None]
        cols = torch.arange(self.clock, device=dev)
        # the token at position i (column first + i) sees the columns first .. first + i
        mask = ~((cols[None, :] >= first) & (cols[None, :] <= first + positions[0, :, None]))
        ctx = self.context
        ctx.enable_prefill_mode()
        ctx.batch_size_offset, ctx.sequence_len_offset, ctx.rope_positions = slot, first + cached, positions
        try:
            logits = self.model.forward(tokens, positions, mask[None, None], ctx, all_positions=all_logits)
        finally:
            ctx.batch_size_offset, ctx.rope_positions = 0, None
        self.start[slot], self.length[slot] = first, n
        if self.prefix is not None:
            self.prefix.store(ids, self._memory(), slot, first)
        return logits[0]

    def _memory(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each local layer's cached keys and values, [columns, slots, ...], in layer order."""
        memory = self.context.key_value_memory_dict
        return [memory[layer] for layer in sorted(memory)]

    def step(self, tokens: dict[int, int]) -> dict[int, torch.Tensor]:
        """Feed each busy slot its next token (``tokens``: slot -> id, every busy slot once): next-token
        logits [vocab] per slot."""
        busy = self.busy()
        assert sorted(tokens) == busy, (sorted(tokens), busy)
        if self.clock == self.capacity:
            self._shift(-min(self.start[s] for s in busy))
        b = busy[-1] + 1  # rows 0 .. the last busy slot; idle rows in between see only themselves
        dev = self.model.device
        ids = torch.zeros(b, 1, dtype=torch.long)
        positions = torch.zeros(b, 1, dtype=torch.long)
        first = torch.full((b, 1), self.clock, dtype=torch.long)
        for s in busy:
            ids[s, 0], positions[s, 0], first[s, 0] = tokens[s], self.length[s], self.start[s]
        ids, positions, first = ids.to(dev), positions.to(dev), first.to(dev)
        mask = torch.arange(self.clock + 1, device=dev)[None, :] < first  # [b, clock + 1], True = not this sequence's
        ctx = self.context
        ctx.enable_decode_mode()
        ctx.batch_size_offset, ctx.sequence_len_offset, ctx.rope_positions = 0, self.clock, positions
        try:
            logits = self.model.forward(ids, positions, mask[:, None, None, :], ctx)
        finally:
            ctx.rope_positions = None
        self.clock += 1
        for s in busy:
            self.length[s] += 1
        return {s: logits[s] for s in busy}

    def ping(self) -> None:
        """Nothing: rank 0's sign of life while no request runs."""

    def release(self, slot: int) -> None:
        self.start[slot], self.length[slot] = None, 0

    def _shift(self, by: int) -> None:
        """Move every cached column ``by`` columns right (left when negative), with the clock."""
        if by == 0:
            return
        if by < 0 and any(self.start[s] + by < 0 for s in self.busy()) or self.clock + by > self.capacity:
            raise AssertionError(f"cannot shift the cache by {by}")
        with torch.inference_mode():
            for keys, values in self.context.key_value_memory_dict.values():
                for t in (keys, values):
                    if by > 0:
                        t[by : self.clock + by] = t[: self.clock].clone()
                    else:
                        t[: self.clock + by] = t[-by : self.clock].clone()
        for s in self.busy():
            self.start[s] += by
        self.clock += by
        self.shifts += 1
