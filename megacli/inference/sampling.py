"""Greedy and sampled decoding: choosing tokens from next-token logits, and the decoding loops of
GPT (KV cache) and T5 (encoder once, decoder over the prefix).

The choice functions are pure tensor functions, no model and no process group: the loops feed
them logits that every rank holds in full, so every rank makes the same choice.
"""

from __future__ import annotations

import torch

from megacli.inference.runner import kv_cache, left_padded


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Hugging Face's rule: a token already in the sequence has its logit divided by `penalty`
    when positive, multiplied when negative. seen: [b, n] token ids (may repeat)."""
    if penalty == 1.0:
        return logits
    picked = logits.gather(1, seen)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.scatter(1, seen, picked)


def penalized(presence: float, frequency: float, bias: dict[int, float]) -> bool:
    """Whether OpenAI's presence or frequency penalty or a logit bias changes any logit."""
    return bool(presence or frequency or bias)


def openai_penalties(logits: torch.Tensor, generated: list[int], *, presence: float, frequency: float,
                     bias: dict[int, float]) -> torch.Tensor:
    """OpenAI's rule for one row [vocab]: each token's logit minus frequency x (times it was generated)
    and minus presence once it was generated at all, plus its logit_bias."""
    if not penalized(presence, frequency, bias):
        return logits
    out = logits.float().clone()
    if generated and (presence or frequency):
        counts = torch.bincount(torch.tensor(generated), minlength=out.size(-1))[: out.size(-1)].float()
        out -= counts * frequency + (counts > 0).float() * presence
    for token, value in bias.items():
        out[token] += value
    return out


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the most likely tokens until their probability reaches p (always at least one)."""
    if p <= 0 or p >= 1:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cumulative - sorted_logits.softmax(-1) >= p  # the mass before this token already reaches p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature as float64 scores whose best token scores 0, finite or -inf for every
    temperature > 0 (1e-300 and inf included): shifted by the row's best logit before dividing, so
    nothing overflows. NaN logits count as -inf; a row without a finite logit scores every token 0."""
    scores = logits.double().nan_to_num(nan=float("-inf"), posinf=torch.finfo(torch.float64).max, neginf=float("-inf"))
    best = scores.amax(-1, keepdim=True)
    excluded = scores == float("-inf")
    shifted = (scores - torch.where(best == float("-inf"), 0.0, best)) / temperature
    shifted = shifted.masked_fill(excluded, float("-inf")).nan_to_num(nan=0.0, neginf=float("-inf"))
    return torch.where((best == float("-inf")).expand_as(shifted), 0.0, shifted)


def choose(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row: argmax at temperature 0, else a sample after temperature and filters."""
    if temperature == 0:
        return logits.argmax(-1)
    scores = top_p_filter(top_k_filter(tempered(logits, temperature), top_k), top_p)
    return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(-1)


def decayed_top_p(top_p: float, decay: float, bound: float) -> float:
    """Megatron-LM's top_p decay after each generated token."""
    if not decay or not top_p:
        return top_p
    return max(top_p * decay, bound)


class Picks:
    """What a batch has generated so far: tokens, their log-probabilities, which rows have stopped
    (a stop token, or ``stopped_by_text(tokens)``); ``next`` chooses and records the next tokens."""

    def __init__(self, gen, batch: int, *, sampler: torch.Generator, stop_ids: set[int], stopped_by_text):
        self.g, self.sampler, self.stop_ids, self.stopped_by_text = gen, sampler, stop_ids, stopped_by_text
        self.top_p = gen.top_p
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.logprobs: list[list[float]] = [[] for _ in range(batch)]
        self.done = torch.zeros(batch, dtype=torch.bool)

    def next(self, logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Each row's next token from its logits [b, vocab] and the ids seen so far [b, n]."""
        g = self.g
        scores = repetition_penalty(logits, seen, g.repetition_penalty)
        nxt = choose(scores, temperature=g.temperature, top_k=g.top_k, top_p=self.top_p, generator=self.sampler)
        self.top_p = decayed_top_p(self.top_p, g.top_p_decay, g.top_p_bound)
        lp = torch.log_softmax(logits.float(), -1).gather(1, nxt[:, None]).squeeze(1)
        for i, tokens in enumerate(self.tokens):
            if not self.done[i]:
                tokens.append(int(nxt[i]))
                self.logprobs[i].append(float(lp[i]))
                self.done[i] = int(nxt[i]) in self.stop_ids or self.stopped_by_text(tokens)
        return nxt


def sample(model, encoded: list[list[int]], picks: Picks, *, max_new_tokens: int, use_cache: bool, on_token=None) -> Picks:
    """Decode with a GPT ``runner.Model``: the prompts once, then one token per step."""
    batch = left_padded(encoded, max_new_tokens=max_new_tokens, device=model.device)
    tokens = batch.tokens
    cache = kv_cache(len(encoded), tokens.size(1), use_cache=use_cache)
    logits = model.prefill(batch, cache)
    for t in range(max_new_tokens):
        cur = batch.width + t
        tokens[:, cur] = picks.next(logits, tokens[:, :cur])
        if on_token is not None:
            on_token(picks.tokens)
        if picks.done.all() or t + 1 == max_new_tokens:
            break
        logits = model.step(tokens, batch, cur, cache)
    return picks


def sample_seq2seq(model, encoded: list[list[int]], picks: Picks, *, max_new_tokens: int, pad: int,
                   on_token=None) -> Picks:
    """Decode with a T5 ``runner.Seq2Seq``: the prompts go to the encoder once, the decoder starts
    from its decoder_start token."""
    enc, enc_pad = model.encoder_inputs(encoded, pad)
    hidden = model.encode(enc, enc_pad)
    dec = torch.full((len(encoded), 1), model.decoder_start, dtype=torch.long, device=model.device)
    for _ in range(max_new_tokens):
        nxt = picks.next(model.logits(enc, hidden, enc_pad, dec), dec)
        dec = torch.cat([dec, nxt[:, None]], 1)
        if on_token is not None:
            on_token(picks.tokens)
        if picks.done.all():
            break
    return picks
