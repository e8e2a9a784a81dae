"""Core attention for Megatron-Core layer specs: SDPA underneath, ALiBi, ring context parallelism.

``CoreAttention`` is a drop-in for Megatron-Core's ``DotProductAttention`` (same constructor and
forward) as the ``core_attention`` of ``SelfAttentionSubmodules``, e.g.
``ModuleSpec(module=CoreAttention, params={"position_bias": "alibi"})`` (``build_module`` passes
spec params as keyword arguments).

* Context-parallel size 1: ``torch.nn.functional.scaled_dot_product_attention`` (flash / cuDNN /
  memory-efficient kernels on CUDA), with ``is_causal`` when no explicit mask or bias is needed.
* Sliding-window attention (Megatron's ``window_size`` = (w, 0) on the layers
  ``window_attn_skip_freq`` selects): query i sees keys i - w .. i, a banded causal mask; keys no
  query can see (a long KV cache while decoding) are dropped before the kernel runs.
* ``softcap``: scores capped to softcap * tanh(score / softcap) before the mask (Gemma 2), as
  explicit matmuls (no SDPA kernel takes a cap).
* Context-parallel size > 1: exact ring attention over the CP group. Keys/values travel around the
  ring by point-to-point sends; partial results are merged with their log-sum-exp; the backward is
  a second ring pass that recomputes each block (flash-style) and sends key/value gradients home.

Masks follow Megatron: ``attention_mask`` is boolean with True = masked. Rows with every key masked
produce zeros (Megatron's ``DotProductAttention`` averages all values there instead).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)
_POSITION_BIASES = ("none", "alibi")


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi head slopes (Press et al., 2022; as in BLOOM): 2^(-8i/n), i = 1..n, for n a power of
    two; otherwise those of the largest power of two below n, then every other slope of twice it."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    return geometric(closest) + geometric(2 * closest)[0::2][: num_heads - closest]


def alibi_bias(slopes: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """Additive ALiBi bias -slope * |i - j| for query positions ``qpos`` and key positions ``kpos``;
    ``slopes`` is shaped to broadcast against [..., sq, sk]. On the causal region (j <= i) this is
    the paper's slope * (j - i); the symmetric form keeps bidirectional attention sensible."""
    return -slopes * (qpos[:, None] - kpos[None, :]).abs()


class CoreAttention(MegatronModule):
    """Megatron-Core core attention on ``scaled_dot_product_attention``, with optional ALiBi
    (``position_bias="alibi"``) and ring context parallelism.

    query [sq, b, np, hn], key/value [sk, b, ng, hn] (ng query groups, np a multiple of ng),
    output [sq, b, np * hn]; heads are this tensor-parallel rank's.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        position_bias: str = "none",
        softcap: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        _check_supported(config, attention_type, cp_comm_type, position_bias)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.position_bias = position_bias

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        cp_group = getattr(pg_collection, "cp", None)
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        self.softcap = softcap
        # keys before i - window are hidden from query i (None: the whole prefix)
        self.window = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number):
            left, right = config.window_size
            if right != 0 or left < 0 or attention_type != "self" or attn_mask_type not in _CAUSAL_TYPES:
                raise NotImplementedError(f"CoreAttention's sliding window is causal self-attention with window_size "
                                          f"(w, 0), not {config.window_size} on {attention_type} {attn_mask_type}")
            self.window = left
        if self.cp_group is not None and softcap is not None:
            raise NotImplementedError("soft-capped attention has no context-parallel ring yet")

        tp_size = self.tp_group.size()
        # Multi-latent attention passes its query/key (k_channels) and value (v_channels) head widths.
        if v_channels is not None and v_channels != (k_channels or config.kv_channels) and self.cp_group is not None:
            raise NotImplementedError("ring attention needs keys and values of one head width")
        self.hidden_size_per_attention_head = config.kv_channels
        self.hidden_size_per_partition = divide(config.kv_channels * config.num_attention_heads, tp_size)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

        # As DotProductAttention: with query-key layer scaling its matmul runs at scale/layer and
        # the softmax multiplies the layer back, so the net scale is unchanged. Our kernels keep
        # scores in fp32 (the fp16 overflow that scaling guards against cannot happen): apply it.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        layer_scale = self.layer_number if config.apply_query_key_layer_scaling else 1
        self.softmax_scale /= layer_scale
        self.effective_scale = self.softmax_scale * layer_scale

        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

        self.alibi_slopes = None
        if position_bias == "alibi":
            first = self.tp_group.rank() * self.num_attention_heads_per_partition
            heads = alibi_slopes(config.num_attention_heads)
            self.alibi_slopes = heads[first : first + self.num_attention_heads_per_partition]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("CoreAttention does not support packed sequences (THD) yet")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        # A windowed layer is causal self-attention; decoding calls it with no_mask (one query, last)
        causal = mask_type in _CAUSAL_TYPES or self.window is not None
        dropout_p = self.dropout_p if self.training else 0.0
        with self._dropout_rng(dropout_p):
            if self.cp_group is None:
                return self._attend_local(query, key, value, attention_mask, causal, attention_bias,
                                          dropout_p)
            if attention_bias is not None:
                raise NotImplementedError("attention_bias with context parallelism is not supported yet")
            return self._attend_ring(query, key, value, attention_mask, causal, dropout_p)

    def _dropout_rng(self, dropout_p: float):
        """Dropout draws from the model-parallel RNG stream, as in DotProductAttention."""
        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _slopes(self, shape, device) -> torch.Tensor | None:
        if self.alibi_slopes is None:
            return None
        return torch.tensor(self.alibi_slopes, dtype=torch.float32, device=device).view(shape)

    def _attend_local(self, query, key, value, attention_mask, causal, attention_bias, dropout_p):
        sq, b, np_, hn = query.shape
        window = self.window if causal else None
        if attention_mask is not None and attention_mask.size(-1) > key.size(0):
            attention_mask = attention_mask[..., -key.size(0):]  # a windowed KV cache holds the last keys only
        drop = 0 if window is None else key.size(0) - sq - window
        if drop > 0:  # keys no query sees (queries are the last sq positions)
            key, value = key[drop:], value[drop:]
            if attention_mask is not None and attention_mask.size(-1) > 1:
                attention_mask = attention_mask[..., drop:]
            if attention_bias is not None and attention_bias.size(-1) > 1:
                attention_bias = attention_bias[..., drop:]
        sk, ng = key.size(0), key.size(2)
        if window is not None and window >= sk - 1:
            window = None  # every key is inside it
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        bias = attention_bias
        slopes = self._slopes((np_, 1, 1), query.device)
        if slopes is not None:  # queries are the last sq of sk positions (bottom-right aligned)
            positions = torch.arange(sk, device=query.device)
            alibi = alibi_bias(slopes, positions[sk - sq :], positions)
            bias = alibi if bias is None else bias + alibi
        attn_mask, is_causal = _sdpa_mask(sq, sk, causal and sq > 1, attention_mask, bias, q.dtype, q.device, window)
        if self.softcap is not None:
            if is_causal:
                attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
            out = _capped_attention(q, k, v, attn_mask, scale=self.effective_scale, cap=self.softcap,
                                    dropout_p=dropout_p)
            return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * value.size(-1))
        # Native GQA is a flash-kernel feature; the kernels that take a mask need as many key heads
        # as query heads: either a query group's heads become rows of one head (a boolean mask
        # shared by all heads), or keys and values are repeated (a per-head bias).
        gqa = np_ != ng and attn_mask is None
        fold = np_ != ng and not gqa and attn_mask.dtype == torch.bool and attn_mask.dim() <= 4 and (
            attn_mask.dim() < 4 or attn_mask.size(1) == 1)
        if fold:
            r = np_ // ng
            q = q.reshape(b, ng, r * sq, hn)  # head g·r + j, position t -> head g, row j·sq + t
            mask4 = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
            attn_mask = mask4.expand(mask4.size(0), 1, sq, sk).unsqueeze(2).expand(-1, -1, r, -1, -1)
            attn_mask = attn_mask.reshape(mask4.size(0), 1, r * sq, sk)
        elif np_ != ng and not gqa:
            k, v = (t.repeat_interleave(np_ // ng, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=self.effective_scale, enable_gqa=gqa,
        )
        hv = value.size(-1)
        return out.reshape(b, np_, sq, hv).permute(2, 0, 1, 3).reshape(sq, b, np_ * hv)

    def _attend_ring(self, query, key, value, attention_mask, causal, dropout_p):
        s, b, np_, hn = query.shape
        ng = key.size(2)
        # Heads as (group, member): query head h uses key/value group h // (np/ng).
        q = query.permute(1, 2, 0, 3).reshape(b, ng, np_ // ng, s, hn)
        k, v = (t.permute(1, 2, 0, 3).unsqueeze(2) for t in (key, value))  # [b, ng, 1, sk, hn]
        slopes = self._slopes((ng, np_ // ng, 1, 1), query.device)
        out = ring_attention(q, k, v, self.cp_group, causal=causal, scale=self.effective_scale, window=self.window,
                             slopes=slopes, mask=attention_mask, dropout_p=dropout_p)
        return out.reshape(b, np_, s, hn).permute(2, 0, 1, 3).reshape(s, b, np_ * hn)


def _check_supported(config, attention_type, cp_comm_type, position_bias) -> None:
    if position_bias not in _POSITION_BIASES:
        raise ValueError(f"position_bias must be one of {_POSITION_BIASES}, got {position_bias!r}")
    if position_bias == "alibi" and attention_type != "self":
        raise ValueError("ALiBi is a self-attention position bias")
    if cp_comm_type not in (None, "p2p"):
        raise NotImplementedError(f"CoreAttention's context parallelism is a p2p ring, not {cp_comm_type!r}")
    if config.softmax_type != "vanilla":
        raise NotImplementedError(f"CoreAttention has the vanilla softmax only, not {config.softmax_type!r}")


def _sdpa_mask(sq, sk, causal, attention_mask, bias, dtype, device, window=None):
    """SDPA's (attn_mask, is_causal) from Megatron's convention (boolean, True = masked) plus an
    optional additive bias. SDPA wants True = attend, or a float mask in the query dtype. With
    ``window`` (causal only), query i (bottom-right aligned) sees keys i - window .. i."""
    if causal and attention_mask is None and bias is None and sq == sk and window is None:
        return None, True
    allowed = None if attention_mask is None else ~attention_mask
    if causal:
        below = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)
        if window is not None:
            below = below.triu(diagonal=sk - sq - window)
        allowed = below if allowed is None else allowed & below
    if bias is None:
        return allowed, False
    bias = bias.to(dtype)
    return (bias if allowed is None else torch.where(allowed, bias, float("-inf"))), False


def _capped_attention(q, k, v, attn_mask, *, scale: float, cap: float, dropout_p: float):
    """Attention with soft-capped scores (as Hugging Face's Gemma 2 eager attention): softmax over
    cap * tanh(scale * q.k / cap) plus the mask, in fp32. q [b, np, sq, hn], k/v [b, ng, sk, hn];
    attn_mask: boolean (True = attend) or additive, broadcastable to [b, np, sq, sk], or None.
    Rows with nothing to attend to give zeros. Returns [b, np, sq, hn]."""
    np_, ng = q.size(1), k.size(1)
    if np_ != ng:
        k, v = (t.repeat_interleave(np_ // ng, dim=1) for t in (k, v))
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(acc)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(v.dtype), v)


# ---------------------------------------------------------------------------------------------
# Ring attention (context parallelism)


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
