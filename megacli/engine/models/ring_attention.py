"""Exact ring attention over a context-parallel group (CoreAttention's path for CP > 1).

Keys/values travel around the ring by point-to-point sends; partial results are merged with their
log-sum-exp; the backward is a second ring pass that recomputes each block (flash-style) and sends
key/value gradients home. Sequences are in Megatron's load-balanced context-parallel layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megacli.engine.models.alibi import alibi_bias


def ring_attention(q, k, v, group, *, causal: bool, scale: float, slopes=None, mask=None, window: int | None = None,
                   dropout_p: float = 0.0):
    """Exact attention of this rank's queries over the keys/values of the whole ring ``group``.

    q [b, ng, r, sq, hn] (r query heads per key/value group), k/v [b, ng, 1, sk, hn], all in
    Megatron's load-balanced context-parallel layout (see ``_Ring.positions``); slopes: ALiBi
    slopes shaped [ng, r, 1, 1] or None; mask: boolean [b|1, 1, sq|1, sk * cp], True = masked,
    local queries by global keys (as ``get_batch_on_this_cp_rank`` cuts it); window: causal
    queries see keys down to position - window (None: all). ``group=None`` is a
    ring of one. Returns [b, ng, r, sq, hn] in q's dtype; block maths runs in fp32 (or fp64).
    """
    if mask is not None and mask.dim() != 4:
        raise ValueError(f"ring attention wants a [b, 1, sq, sk] mask, got shape {tuple(mask.shape)}")
    return _RingAttention.apply(q, k, v, group, causal, scale, slopes, mask, dropout_p, window)


class _Ring:
    """This rank's place in the context-parallel ring and Megatron's load-balanced layout."""

    def __init__(self, group):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def positions(self, rank: int, length: int, device) -> torch.Tensor:
        """Global positions of ``rank``'s ``length`` local tokens: the sequence is cut into 2*size
        chunks and rank i holds chunks i and 2*size-1-i, so causal work is balanced."""
        if self.size == 1:
            return torch.arange(length, device=device)
        half = length // 2
        chunk = torch.arange(half, device=device)
        return torch.cat((chunk + rank * half, chunk + (2 * self.size - 1 - rank) * half))

    def block(self, step: int, causal: bool, sq: int, sk: int):
        """(source rank, query rows, key rows, causal) of the block computed at ``step``, when this
        rank r holds the keys/values of src = (r - step) mod size. Causal, we hold chunks r and
        2c-1-r. If src < r, its chunk src precedes both of ours and its chunk 2c-1-src follows
        both: all our queries see its first half, fully. If src > r, both its chunks follow our
        chunk r and precede our chunk 2c-1-r: our second half sees all of it, fully. Only our own
        block needs a causal mask."""
        src = (self.rank - step) % self.size
        every = slice(None)
        if not causal:
            return src, every, every, False
        if src == self.rank:
            return src, every, every, True
        if src < self.rank:
            return src, every, slice(0, sk // 2), False
        return src, slice(sq // 2, None), every, False

    def shift(self, tensor: torch.Tensor, tag: int):
        """Start sending ``tensor`` to the next rank and receiving the previous rank's; calling
        the result waits and returns the received tensor. Distinct tags keep concurrent shifts
        apart on gloo (NCCL orders them by issue, the same on every rank)."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ])

        def finish() -> torch.Tensor:
            for work in works:
                work.wait()
            return received

        return finish


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, slopes, mask, dropout_p, window):
        ring = _Ring(group)
        sq, sk = q.size(-2), k.size(-2)
        _check_ring_shapes(ring, causal, sq, sk, mask)
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        rng_state = _device_rng_state(q.device) if dropout_p > 0 else None
        kv = torch.stack((k, v))
        for step in range(ring.size):
            next_kv = ring.shift(kv, tag=1) if step < ring.size - 1 else None
            src, rows, cols, block_causal = ring.block(step, causal, sq, sk)
            bias = _block_bias(ring, src, rows, cols, block_causal, slopes, mask, sq, sk, q.device, window)
            block_out, block_lse = _block_forward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                                  scale, bias, dropout_p)
            _merge(out, lse, rows, block_out, block_lse)
            if next_kv is not None:
                kv = next_kv()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, slopes, mask)
        ctx.group, ctx.causal, ctx.scale, ctx.window = group, causal, scale, window
        ctx.dropout_p, ctx.rng_state = dropout_p, rng_state
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, slopes, mask = ctx.saved_tensors
        ring = _Ring(ctx.group)
        sq, sk = q.size(-2), k.size(-2)
        acc = lse.dtype
        dout = grad_out.to(acc)
        delta = (dout * out.to(acc)).sum(-1)  # rowsum(dO * O) = sum_j P_ij dP_ij over all blocks
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v))
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        with _replayed_rng(q.device, ctx.rng_state):  # redraw the forward's dropout masks
            for step in range(ring.size):
                next_kv = ring.shift(kv, tag=1) if step < ring.size - 1 else None
                src, rows, cols, block_causal = ring.block(step, ctx.causal, sq, sk)
                bias = _block_bias(ring, src, rows, cols, block_causal, slopes, mask, sq, sk, q.device, ctx.window)
                dq_b, dk_b, dv_b = _block_backward(
                    q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], dout[..., rows, :],
                    delta[..., rows], lse[..., rows], ctx.scale, bias, ctx.dropout_p)
                dq[..., rows, :] += dq_b
                dkv[0][..., cols, :] += dk_b
                dkv[1][..., cols, :] += dv_b
                if ring.size > 1:  # key/value gradients follow their block; after size shifts they are home
                    dkv = ring.shift(dkv, tag=2)()
                if next_kv is not None:
                    kv = next_kv()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None, None


def _check_ring_shapes(ring, causal, sq, sk, mask) -> None:
    if ring.size > 1 and (sq % 2 or sk % 2):
        raise ValueError(f"context parallelism needs even local sequence lengths, got {sq} and {sk}")
    if causal and sq != sk:
        raise ValueError("causal ring attention needs equal query and key lengths")
    if mask is not None and mask.size(-1) != sk * ring.size:
        raise ValueError(f"mask has {mask.size(-1)} keys, expected the global {sk * ring.size}")


def _block_bias(ring, src, rows, cols, causal, slopes, mask, sq, sk, device, window=None):
    """Additive fp32 bias (ALiBi, -inf where masked) of one block, from global positions, or None.
    ``window``: keys before query position - window are masked too (sliding-window attention)."""
    qpos = ring.positions(ring.rank, sq, device)[rows]
    kpos = ring.positions(src, sk, device)[cols]
    bias = None if slopes is None else alibi_bias(slopes, qpos, kpos)
    masked = kpos[None, :] > qpos[:, None] if causal else None
    if window is not None:
        far = kpos[None, :] < qpos[:, None] - window
        masked = far if masked is None else masked | far
    if mask is not None:
        block_mask = mask[..., rows, :] if mask.size(-2) > 1 else mask
        block_mask = block_mask.index_select(-1, kpos).unsqueeze(2)  # [b, 1, 1, sq, sk] over (ng, r)
        masked = block_mask if masked is None else masked | block_mask
    if masked is None:
        return bias
    return torch.where(masked, float("-inf"), 0.0 if bias is None else bias)


def _block_scores(q, k, scale, bias, acc):
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    return scores if bias is None else scores + bias


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row with nothing to attend to) -> 0, so exp(s - lse) gives 0 there, not NaN."""
    return torch.where(torch.isfinite(x), x, 0.0)


def _block_forward(q, k, v, scale, bias, dropout_p):
    """One block's softmax-normalised output and per-row log-sum-exp."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = _block_scores(q, k, scale, bias, acc)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    if dropout_p > 0:
        probs = probs * _dropout_keep(probs, dropout_p)
    return torch.matmul(probs, v.to(acc)), lse


def _merge(out, lse, rows, block_out, block_lse) -> None:
    """Online-softmax merge of a block into the running result of query ``rows``, in place:
    lse' = log(e^lse + e^block_lse), out' = out * e^(lse - lse') + block_out * e^(block_lse - lse').
    A row with nothing to attend to so far keeps lse = -inf and out = 0."""
    old = lse[..., rows]
    new = torch.logaddexp(old, block_lse)
    ref = _finite(new)
    out[..., rows, :] = out[..., rows, :] * torch.exp(old - ref).unsqueeze(-1) \
        + block_out * torch.exp(block_lse - ref).unsqueeze(-1)
    lse[..., rows] = new


def _block_backward(q, k, v, dout, delta, lse, scale, bias, dropout_p):
    """Gradients of one block given the final row lse and delta = rowsum(dO * O): with P the
    globally normalised probabilities, dS = P * (dP - delta). Key/value gradients are summed over
    the query heads of each group."""
    acc = lse.dtype
    scores = _block_scores(q, k, scale, bias, acc)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    dprobs = torch.matmul(dout, v.to(acc).transpose(-1, -2))
    kept = probs
    if dropout_p > 0:
        keep = _dropout_keep(probs, dropout_p)
        kept, dprobs = probs * keep, dprobs * keep
    dv = torch.matmul(kept.transpose(-1, -2), dout).sum(2, keepdim=True)
    dscores = probs * (dprobs - delta.unsqueeze(-1))
    dq = torch.matmul(dscores, k.to(acc)) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), q.to(acc)).sum(2, keepdim=True) * scale
    return dq, dk, dv


def _dropout_keep(probs: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(probs).bernoulli_(1.0 - p).div_(1.0 - p)


def _device_rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def _replayed_rng(device: torch.device, state):
    """Run with the generator of ``device`` rewound to ``state``, restoring it afterwards."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield
