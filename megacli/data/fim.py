"""Fill-in-the-middle on token samples, token for token as Megatron-LM's FIM dataset rewrites them.

The sample is cut at EOD tokens into documents; each document (with ``split_sample``: each fragment
between split tokens, after one ``rate`` draw for the whole document) is, with probability ``rate``
(``fragment_rate``), decoded, cut at two random character positions into prefix / middle / suffix,
re-encoded and written as PSM: <prefix> prefix <suffix> suffix <middle> middle, or, with probability
``spm_rate``, SPM: <prefix> <suffix> suffix <middle> prefix middle. As in Megatron-LM, an EOD (split
token) that closes an empty stretch is dropped, the stretch after the last one is always drawn for
(even when empty), and only the whole sample is brought back to its length: cut at its end or padded
there with <pad>.
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


def permute(tokens: np.ndarray, rng: np.random.RandomState, *, rate: float, fim, tokenizer, ids: FIMIds) -> np.ndarray:
    """One document (or fragment) rewritten with probability ``rate``; its length may change."""
    if not rng.binomial(1, rate):
        return tokens
    contents = tokenizer.decode(tokens.tolist())
    if fim.no_prefix is not None and contents.startswith(fim.no_prefix):
        return tokens
    lo, hi = sorted(rng.randint(low=0, high=len(contents) + 1, size=2))
    prefix, middle, suffix = (np.asarray(tokenizer.encode(part), dtype=np.int64)
                              for part in (contents[:lo], contents[lo:hi], contents[hi:]))
    if rng.binomial(1, fim.spm_rate):
        parts = [[ids.prefix, ids.suffix], suffix, [ids.middle], prefix, middle]
    else:
        parts = [[ids.prefix], prefix, [ids.suffix], suffix, [ids.middle], middle]
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def _split_and_permute(tokens: np.ndarray, rng, *, fim, tokenizer, ids: FIMIds) -> np.ndarray:
    rewrite = dict(fim=fim, tokenizer=tokenizer, ids=ids)
    if ids.split is None or not (tokens == ids.split).any():
        return permute(tokens, rng, rate=fim.rate, **rewrite)
    if not rng.binomial(1, fim.rate):
        return tokens
    return _each_segment(tokens, ids.split, lambda part: permute(part, rng, rate=fim.fragment_rate, **rewrite))


def _each_segment(tokens: np.ndarray, separator: int, rewrite) -> np.ndarray:
    """The stretches between separators rewritten; a separator closing an empty stretch is dropped
    and the stretch after the last separator is rewritten even when empty (Megatron-LM's draws)."""
    out, start = [], 0
    for loc in np.flatnonzero(tokens == separator):
        if loc > start:
            out += [rewrite(tokens[start:loc]), np.asarray([separator], dtype=np.int64)]
        start = loc + 1
    out.append(rewrite(tokens[start:]))
    return np.concatenate(out)


def fim_sample(sample: np.ndarray, rng: np.random.RandomState, *, fim, tokenizer, ids: FIMIds) -> np.ndarray:
    """A packed sample with its documents rewritten, cut or padded (<pad>) at its end back to its length."""
    rewritten = _each_segment(sample.astype(np.int64), ids.eod,
                              lambda doc: _split_and_permute(doc, rng, fim=fim, tokenizer=tokenizer, ids=ids))
    if len(rewritten) >= len(sample):
        return rewritten[:len(sample)]
    return np.concatenate([rewritten, np.full(len(sample) - len(rewritten), ids.pad, dtype=np.int64)])
