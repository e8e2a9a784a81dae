"""Beam search: the search itself (pure tensor code, Hugging Face's semantics) and its run over a
GPT ``runner.Model``, whose KV cache follows the beams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megacli.inference.runner import kv_cache, left_padded

NEG = -1.0e9  # a score that never wins (finite, so sums and comparisons stay well-defined)


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


def beam_generate(model, encoded: list[list[int]], *, num_beams: int, max_new_tokens: int, stop_ids: set[int],
                  length_penalty: float, use_cache: bool) -> list[list[int]]:
    """Each prompt's best beam (its generated tokens) with a GPT ``runner.Model``: every prompt
    repeated for its beams, the KV cache reordered as beams are kept."""
    rows = [ids for ids in encoded for _ in range(num_beams)]
    batch = left_padded(rows, max_new_tokens=max_new_tokens, device=model.device)
    cache = kv_cache(len(rows), batch.tokens.size(1), use_cache=use_cache)
    first = model.prefill(batch, cache)
    state = {"cur": batch.width, "tokens": batch.tokens}

    def step(last: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        cur = state["cur"]
        state["tokens"] = state["tokens"][parents]
        state["tokens"][:, cur] = last
        if cache is not None:
            cache.swap_key_value_dict(parents)
        out = model.step(state["tokens"], batch, cur, cache)
        state["cur"] = cur + 1
        return out

    result = beam_search(step, first, batch=len(encoded), num_beams=num_beams, max_new_tokens=max_new_tokens,
                         stop_ids=stop_ids, length_penalty=length_penalty)
    return result.tokens
