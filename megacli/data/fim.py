"""Fill-in-the-middle on token samples, as Megatron-LM's FIM dataset rewrites them.

Each document of a sample (the stretches between EOD tokens) is, with probability ``rate``, decoded,
cut at two random character positions into prefix / middle / suffix, re-encoded and written as
PSM: <prefix> prefix <suffix> suffix <middle> middle, or, with probability ``spm_rate``,
SPM: <prefix> <suffix> suffix <middle> prefix middle. A rewritten document keeps its token count
(the suffix is cut or padded with <pad>); with ``split_sample`` a document is first cut at that
token into fragments, each rewritten with probability ``fragment_rate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megacli.errors import UserError


@dataclass(frozen=True)
class FIMIds:
    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: int | None


def fim_ids(tokenizer, fim) -> FIMIds:
    """The ids of data.fim's tokens in the tokenizer's vocabulary."""
    ids = {t: i for i, t in tokenizer.vocabulary().items()}
    names = {"prefix": fim.prefix_token, "middle": fim.middle_token, "suffix": fim.suffix_token, "pad": fim.pad_token}
    if fim.split_sample is not None:
        names["split"] = fim.split_sample
    missing = [f"data.fim.{'split_sample' if k == 'split' else k + '_token'} = {v!r}" for k, v in names.items() if v not in ids]
    if missing:
        raise UserError(f"fill-in-the-middle: the tokenizer {tokenizer.name!r} has no token for {', '.join(missing)} "
                        f"(use a tokenizer with FIM tokens, or name its tokens in data.fim)")
    return FIMIds(eod=tokenizer.eod, split=ids.get(fim.split_sample), **{k: ids[v] for k, v in names.items() if k != "split"})


def permute(tokens: np.ndarray, rng: np.random.RandomState, *, rate: float, spm_rate: float, tokenizer,
            ids: FIMIds) -> np.ndarray:
    """One document (or fragment) rewritten, with probability ``rate``, keeping its length."""
    if not rng.binomial(1, rate):
        return tokens
    contents = tokenizer.decode(tokens.tolist())
    lo, hi = sorted(rng.randint(low=0, high=len(contents) + 1, size=2))
    prefix, middle, suffix = (np.asarray(tokenizer.encode(part), dtype=np.int64)
                              for part in (contents[:lo], contents[lo:hi], contents[hi:]))
    diff = len(prefix) + len(middle) + len(suffix) + 3 - len(tokens)
    if diff > 0:
        if len(suffix) <= diff:  # no room to keep the length: leave the document as it is
            return tokens
        suffix = suffix[:len(suffix) - diff]
    elif diff < 0:
        suffix = np.concatenate([suffix, np.full(-diff, ids.pad, dtype=np.int64)])
    if rng.binomial(1, spm_rate):
        parts = [[ids.prefix, ids.suffix], suffix, [ids.middle], prefix, middle]
    else:
        parts = [[ids.prefix], prefix, [ids.suffix], suffix, [ids.middle], middle]
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def _split_and_permute(tokens: np.ndarray, rng, *, fim, tokenizer, ids: FIMIds) -> np.ndarray:
    rewrite = dict(spm_rate=fim.spm_rate, tokenizer=tokenizer, ids=ids)
    if ids.split is None or not (tokens == ids.split).any():
        return permute(tokens, rng, rate=fim.rate, **rewrite)
    if not rng.binomial(1, fim.rate):
        return tokens
    return _each_segment(tokens, ids.split, lambda part: permute(part, rng, rate=fim.fragment_rate, **rewrite))


def _each_segment(tokens: np.ndarray, separator: int, rewrite) -> np.ndarray:
    """The stretches between separators rewritten (empty ones skipped), separators kept."""
    out, start = [], 0
    for loc in np.flatnonzero(tokens == separator):
        if loc > start:
            out.append(rewrite(tokens[start:loc]))
        out.append(np.asarray([separator], dtype=np.int64))
        start = loc + 1
    out.append(rewrite(tokens[start:]) if start < len(tokens) else tokens[start:])
    return np.concatenate(out)


def fim_sample(sample: np.ndarray, rng: np.random.RandomState, *, fim, tokenizer, ids: FIMIds) -> np.ndarray:
    """A packed sample with its documents rewritten, cut or padded (<pad>) back to its length."""
    rewritten = _each_segment(sample.astype(np.int64), ids.eod,
                              lambda doc: _split_and_permute(doc, rng, fim=fim, tokenizer=tokenizer, ids=ids))
    if len(rewritten) >= len(sample):
        return rewritten[:len(sample)]
    return np.concatenate([rewritten, np.full(len(sample) - len(rewritten), ids.pad, dtype=np.int64)])
