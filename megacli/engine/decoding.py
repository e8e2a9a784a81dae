"""Choosing tokens from next-token logits: greedy, sampling filters, and beam search.

Pure tensor functions, no model and no process group: the generation loop (engine.generate)
feeds them logits that every rank holds in full, so every rank makes the same choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

NEG = -1.0e9  # a score that never wins (finite, so sums and comparisons stay well-defined)


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Hugging Face's rule: a token already in the sequence has its logit divided by `penalty`
    when positive, multiplied when negative. seen: [b, n] token ids (may repeat)."""
    if penalty == 1.0:
        return logits
    picked = logits.gather(1, seen)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.scatter(1, seen, picked)


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


def choose(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row: argmax at temperature 0, else a sample after temperature and filters."""
    if temperature == 0:
        return logits.argmax(-1)
    scores = top_p_filter(top_k_filter(logits / temperature, top_k), top_p)
    probs = scores.float().softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def decayed_top_p(top_p: float, decay: float, bound: float) -> float:
    """Megatron-LM's top_p decay after each generated token."""
    if not decay or not top_p:
        return top_p
    return max(top_p * decay, bound)


# ---------------------------------------------------------------- beam search


@dataclass
class BeamResult:
    tokens: list[list[int]]  # per prompt: the best beam's generated tokens (a final stop token included)
    scores: list[float]  # its length-penalised score


def beam_search(step: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], first_logits: torch.Tensor, *,
                batch: int, num_beams: int, max_new_tokens: int, stop_ids: set[int], length_penalty: float) -> BeamResult:
    """Beam search with the semantics of Hugging Face's `generate(num_beams=N)` (early_stopping
    False): at each step keep the best 2N continuations over all beams (more with several stop tokens); continuations that end
    with a stop token (or reach max_new_tokens) are finished hypotheses scored
    sum(logprobs) / length ** length_penalty; the N best unfinished ones run on; a prompt is done
    when no running beam can beat its worst finished hypothesis at the current length.

    first_logits: [batch * num_beams, vocab] after the prompt (beams of a prompt are identical).
    step(tokens [batch*num_beams], beam_rows [batch*num_beams] or None) -> next logits; beam_rows
    says which previous row each running beam continues (the caller reorders its KV cache).
    """
    device = first_logits.device
    keep = max(2, 1 + len(stop_ids)) * num_beams  # enough that N beams survive even if all but one end here
    running_scores = torch.zeros(batch, num_beams, device=device)
    running_scores[:, 1:] = NEG  # identical beams at the start: only the first one spreads
    running = torch.zeros(batch, num_beams, 0, dtype=torch.long, device=device)
    done_tokens = torch.zeros(batch, num_beams, max_new_tokens, dtype=torch.long, device=device)
    done_lengths = torch.zeros(batch, num_beams, dtype=torch.long, device=device)
    done_scores = torch.full((batch, num_beams), NEG, device=device)
    done_any = torch.zeros(batch, num_beams, dtype=torch.bool, device=device)
    can_improve = torch.ones(batch, 1, dtype=torch.bool, device=device)
    top_n = torch.arange(keep, device=device) < num_beams
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    logits = first_logits
    for t in range(max_new_tokens):
        vocab = logits.size(-1)
        logp = torch.log_softmax(logits.float(), dim=-1).view(batch, num_beams, vocab) + running_scores[..., None]
        cand_scores, flat = torch.topk(logp.view(batch, -1), keep, dim=-1)
        cand_beam, cand_token = flat // vocab, flat % vocab
        cand_seq = torch.cat([torch.gather(running, 1, cand_beam[..., None].expand(-1, -1, t)), cand_token[..., None]], -1)
        length = t + 1
        finished = torch.isin(cand_token, stop) | (length >= max_new_tokens)

        # The N best unfinished continuations run on.
        live_scores = cand_scores + finished.float() * NEG
        pick = torch.topk(live_scores, num_beams, dim=-1).indices
        running = torch.gather(cand_seq, 1, pick[..., None].expand(-1, -1, length))
        running_scores = torch.gather(live_scores, 1, pick)
        parent = torch.gather(cand_beam, 1, pick)

        # Finished continuations among the top N enter the finished set if they beat it.
        new_done = finished & top_n[None, :]
        penalised = cand_scores / (length ** length_penalty)
        penalised = penalised + (~can_improve).float() * NEG + (~new_done).float() * NEG
        padded = torch.nn.functional.pad(cand_seq, (0, max_new_tokens - length))
        merged_tokens = torch.cat([done_tokens, padded], 1)
        merged_scores = torch.cat([done_scores, penalised], 1)
        merged_lengths = torch.cat([done_lengths, torch.full_like(cand_token, length)], 1)
        merged_any = torch.cat([done_any, new_done], 1)
        best = torch.topk(merged_scores, num_beams, dim=-1).indices
        done_tokens = torch.gather(merged_tokens, 1, best[..., None].expand(-1, -1, max_new_tokens))
        done_scores = torch.gather(merged_scores, 1, best)
        done_lengths = torch.gather(merged_lengths, 1, best)
        done_any = torch.gather(merged_any, 1, best)

        # Can a running beam still beat the worst finished one (scored at the current length)?
        best_running = running_scores[:, :1] / (length ** length_penalty)  # as Hugging Face: the length so far
        worst_done = torch.where(done_any, done_scores.min(dim=1, keepdim=True).values, torch.tensor(NEG, device=device))
        can_improve = can_improve & (best_running > worst_done).any(-1, keepdim=True)
        if not can_improve.any() or finished.all() or length >= max_new_tokens:
            break
        rows = (parent + torch.arange(batch, device=device)[:, None] * num_beams).view(-1)
        logits = step(running[:, :, -1].reshape(-1), rows)
    tokens = [done_tokens[i, 0, : done_lengths[i, 0]].tolist() for i in range(batch)]
    return BeamResult(tokens=tokens, scores=done_scores[:, 0].tolist())
