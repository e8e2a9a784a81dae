"""Scoring text with a GPT ``runner.Model``: log-likelihood and perplexity, and LAMBADA-style cloze
accuracy."""

from __future__ import annotations

import math

import torch

from megacli.errors import UserError


def windows(ids: list[int], size: int) -> list[tuple[list[int], int]]:
    """(window, first scored index) pairs: texts longer than the context (``size`` tokens) are
    scored in windows of ``size`` tokens; each window scores only the tokens the previous one
    did not."""
    if len(ids) <= size:
        return [(ids, 1)]
    out, scored = [(ids[:size], 1)], size
    while scored < len(ids):
        end = min(scored + size // 2, len(ids))
        window = ids[max(0, end - size) : end]
        out.append((window, len(window) - (end - scored)))
        scored = end
    return out


def _all_logits(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids as a tensor [n], next-token logits at every position [n, vocab])."""
    t = torch.tensor([ids], device=model.device)
    pos = torch.arange(len(ids), device=model.device)[None]
    return t[0], model.forward(t, pos, None, None, all_positions=True)[0]


def loglik(model, ids: list[int], *, context: int) -> tuple[float, int]:
    """(sum of log p(token_i | tokens_<i) over i >= 1, how many tokens that is)."""
    lp_sum, n = 0.0, 0
    for window, start in windows(ids, context):
        t, logits = _all_logits(model, window)
        logp = torch.log_softmax(logits[:-1].float(), -1).gather(1, t[1:, None]).squeeze(1)
        lp_sum += float(logp[start - 1 :].sum())
        n += len(window) - start
    return lp_sum, n


def score(model, encoded: list[list[int]], *, context: int) -> dict:
    """Sum of token log-likelihoods (each token given the ones before it) and perplexity, in all
    and per text."""
    total_lp, total_n = 0.0, 0
    per_text = []
    for ids in encoded:
        lp, n = loglik(model, ids, context=context)
        per_text.append({"logprob": lp, "tokens": n, "perplexity": math.exp(-lp / n) if n else float("nan")})
        total_lp, total_n = total_lp + lp, total_n + n
    return {"texts": len(encoded), "tokens": total_n, "logprob": total_lp,
            "perplexity": math.exp(-total_lp / total_n) if total_n else float("nan"), "per_text": per_text}


def cloze(model, texts: list[str], encode) -> dict:
    """LAMBADA-style: the last word must come out of greedy decoding of its tokens given the
    context (every target token is the argmax), as Megatron-LM's zero-shot evaluation.
    ``encode(text)`` gives a text's token ids."""
    correct = 0
    for text in texts:
        context, _, last = text.rstrip().rpartition(" ")
        if not context:
            raise UserError(f"cloze text {text[:40]!r} has no context before its last word")
        ctx_ids, full = encode(context), encode(context + " " + last)
        t, logits = _all_logits(model, full)
        targets = t[len(ctx_ids) :]
        predicted = logits[len(ctx_ids) - 1 : -1].argmax(-1)
        correct += bool((predicted == targets).all())
    return {"texts": len(texts), "correct": correct, "accuracy": correct / len(texts) if texts else float("nan")}
