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
    """A UserError unless every self-attention of the model is the cached-rotary one rotating its
    own keys and queries (``plain_rope``): what per-sequence positions rely on. Sliding windows
    need nothing more: a sequence's tokens sit in contiguous columns, so the core attention's window
    over columns (bottom-right aligned, as in a single sequence) is its window over positions."""
    from megatron.core.transformer.attention import SelfAttention

    from megacli.engine.models.kv_cache import CachedRotarySelfAttention, plain_rope

    if not plain_rope(model.config):
        raise UserError("megacli serve runs models with RoPE (plain or scaled), learned positions or ALiBi; this "
                        "model's RoPE variant (interleaved, fused, or YaRN scaling cos and sin) is not supported: "
                        "use `megacli generate`")
    for module in model.net.modules():
        if isinstance(module, SelfAttention):
            if type(module) is not CachedRotarySelfAttention:
                raise UserError(f"megacli serve does not run {type(module).__name__} attention (e.g. multi-latent "
                                f"attention): use `megacli generate`")


class Slots:
    """``max_batch`` cache rows of ``capacity`` columns over a ``runner.Model``."""

    def __init__(self, model, *, max_batch: int, capacity: int, prefix: PrefixCache | None = None):
        from megacli.engine.models.kv_cache import DecodeContext

        self.model, self.max_batch, self.capacity = model, max_batch, capacity
        self.prefix = None  # not for the first forward below
        self.context = DecodeContext(max_batch, capacity)
        self.start: list[int | None] = [None] * max_batch  # first column of each busy slot's tokens
        self.length = [0] * max_batch  # tokens in the cache per slot (= the next token's position)
        self.prefilling: set[int] = set()  # busy slots holding only the leading part of their prompt
        self.clock = 0  # the column the next step writes
        self.shifts = 0  # times the cached columns were moved
        # Megatron allocates the cache (uninitialised) at the first forward: one token through it,
        # then zeros, so that masked columns never hold NaN (0 x NaN would reach the outputs)
        self.admit([0], [[0]])
        self.release(0)
        with torch.inference_mode():  # the cache is made of inference tensors
            for keys, values in self.context.key_value_memory_dict.values():
                keys.zero_()
                values.zero_()
        self.prefix = prefix

    def busy(self) -> list[int]:
        return [s for s, start in enumerate(self.start) if start is not None]

    def decoding(self) -> list[int]:
        return [s for s in self.busy() if s not in self.prefilling]

    def admit(self, slots: list[int], prompts: list[list[int]], *, all_logits: bool = False,
              partial: list[bool] | None = None) -> list[torch.Tensor]:
        """Prefill each prompt into its slot (``slots``: consecutive) in one forward, left-padded to
        the longest: each one's next-token logits [vocab] (all_logits, one prompt: [len, vocab], the
        logits after every prompt token). A slot is free, or still prefilling: it holds the leading
        tokens of ``prompts[i]`` from an earlier admit, and only the rest is computed. ``partial[i]``:
        ``prompts[i]`` is only the leading part of a longer prompt, so the slot stays out of ``step``
        until a later admit gives the whole."""
        assert slots == list(range(slots[0], slots[0] + len(slots))), slots
        assert all(self.start[s] is None or s in self.prefilling for s in slots), f"a slot of {slots} is busy"
        assert not all_logits or len(prompts) == 1
        partial = partial or [False] * len(slots)
        lengths = torch.tensor([len(ids) for ids in prompts])
        longest = int(lengths.max())
        if not self.busy():
            self.clock = longest
        elif self.clock < longest:
            self._shift(longest - self.clock)
        first = self.clock - lengths  # each prompt ends at the clock
        held = [self.length[s] if s in self.prefilling else 0 for s in slots]  # tokens already in the row
        reused = [self.prefix.reusable(ids) if self.prefix is not None and not all_logits else [] for ids in prompts]
        from_cache = [len(r) * self.prefix.block if r else 0 for r in reused]
        cached = torch.tensor([max(h, c) for h, c in zip(held, from_cache)])
        for slot, hashes, start, h, c in zip(slots, reused, first.tolist(), held, from_cache):
            if h:
                self._move_row(slot, self.start[slot], start, h)
            if c > h:  # over the held tokens too: the same prefix
                self.prefix.load(hashes, self._memory(), slot, start)
        # the columns clock - width .. clock of every row: each prompt's last `width` positions (its
        # uncached tokens, and cached ones computed again where a longer prompt needs the width),
        # pads before a short prompt's first token
        width = int((lengths - cached).max())
        if self.prefix is not None:
            spared = lengths - width  # leading tokens not computed
            self.prefix.hit_tokens += int((torch.minimum(cached, spared).clamp(min=0)
                                           - torch.minimum(torch.tensor(held), spared).clamp(min=0)).sum())
        offset = self.clock - width
        positions = lengths[:, None] - width + torch.arange(width)[None, :]
        real = positions >= 0
        padded = [[0] * (width - len(ids)) + ids[-width:] for ids in prompts]
        tokens = torch.tensor(padded, dtype=torch.long)
        positions = positions.clamp(min=0)
        cols = torch.arange(self.clock)[None, None, :]
        query_col = (offset + torch.arange(width))[None, :, None]
        # a prompt's token sees its columns up to itself; a pad only itself (never read again)
        sees = torch.where(real[..., None], (cols >= first[:, None, None]) & (cols <= query_col), cols == query_col)
        dev = self.model.device
        tokens, positions, mask = tokens.to(dev), positions.to(dev), (~sees)[:, None].to(dev)
        ctx = self.context
        ctx.enable_prefill_mode()
        ctx.batch_size_offset, ctx.sequence_len_offset, ctx.rope_positions = slots[0], offset, positions
        ctx.first_column = int(first.min())  # no query of the group sees a column before it
        try:
            logits = self.model.forward(tokens, positions, mask, ctx, all_positions=all_logits)
        finally:
            ctx.batch_size_offset, ctx.rope_positions, ctx.first_column = 0, None, 0
        for slot, ids, start, part in zip(slots, prompts, first.tolist(), partial):
            self.start[slot], self.length[slot] = start, len(ids)
            (self.prefilling.add if part else self.prefilling.discard)(slot)
            if self.prefix is not None:
                self.prefix.store(ids, self._memory(), slot, start)
        return list(logits)

    def cached_tokens(self, ids: list[int]) -> int:
        """The leading tokens of ``ids`` whose keys and values the prefix cache holds."""
        return len(self.prefix.reusable(ids)) * self.prefix.block if self.prefix is not None else 0

    def _move_row(self, slot: int, src: int, dst: int, n: int) -> None:
        """The ``n`` cached columns of one slot from column ``src`` to ``dst``: a row's keys are
        rotated by its own positions, so its tokens may sit at any columns."""
        if src == dst:
            return
        with torch.inference_mode():
            for keys, values in self._memory():
                for t in (keys, values):
                    t[dst : dst + n, slot] = t[src : src + n, slot].clone()

    def _memory(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each local layer's cached keys and values, [columns, slots, ...], in layer order."""
        memory = self.context.key_value_memory_dict
        return [memory[layer] for layer in sorted(memory)]

    def step(self, tokens: dict[int, int]) -> torch.Tensor:
        """Feed each decoding slot its next token (``tokens``: slot -> id, every one of them once):
        next-token logits [rows, vocab], row s for slot s (rows up to the last decoding slot; the
        others' rows mean nothing). A slot still prefilling sits the step out."""
        busy = self.decoding()
        assert sorted(tokens) == busy, (sorted(tokens), busy)
        if self.clock == self.capacity:
            self._shift(-min(self.start[s] for s in self.busy()))
        b = busy[-1] + 1  # rows 0 .. the last decoding slot; other rows in between see only themselves
        dev = self.model.device
        ids, positions, first = [0] * b, [0] * b, [self.clock] * b
        for s in busy:
            ids[s], positions[s], first[s] = tokens[s], self.length[s], self.start[s]
        ids, positions, first = (torch.tensor(v, dtype=torch.long, device=dev)[:, None] for v in (ids, positions, first))
        # attention reads the columns from the oldest busy sequence's first one to the clock
        oldest = min(self.start[s] for s in busy)
        mask = torch.arange(oldest, self.clock + 1, device=dev)[None, :] < first  # True = not this sequence's
        ctx = self.context
        ctx.enable_decode_mode()
        ctx.batch_size_offset, ctx.sequence_len_offset, ctx.rope_positions = 0, self.clock, positions
        ctx.first_column = oldest
        try:
            logits = self.model.forward(ids, positions, mask[:, None, None, :], ctx)
        finally:
            ctx.rope_positions, ctx.first_column = None, 0
        self.clock += 1
        for s in busy:
            self.length[s] += 1
        return logits

    def ping(self) -> None:
        """Nothing: rank 0's sign of life while no request runs."""

    def release(self, slot: int) -> None:
        self.start[slot], self.length[slot] = None, 0
        self.prefilling.discard(slot)

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
