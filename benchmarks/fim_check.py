"""megacli's fill-in-the-middle against Megatron-LM's FIM dataset, sample for sample.

    python benchmarks/fim_check.py --megatron /path/to/Megatron-LM [--samples 1000]

Megatron-LM's ``GPTFIMDataset`` is imported from the checkout at run time and given one sample as
its whole dataset (no index files, no tokenizer files: a one-id-per-character tokenizer stands in);
both sides get a fresh ``RandomState`` with the same seed for each sample. Prints, per setting,
how many samples came out identical.
"""

from __future__ import annotations

import argparse
import re
import sys
from types import SimpleNamespace

import numpy as np

from megacli.data.fim import fim_ids, fim_sample
from megacli.recipe.stream import FIMSection

SPECIALS = ["<eod>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|file|>"]
ALPHABET = "abcdefghilmoprsux_<|> ()=:\n"  # covers the specials' characters: a cut may split one


class CharTokenizer:
    """One id per character of ALPHABET, then the special tokens (each one id)."""

    name = "chars"

    def __init__(self):
        self.vocab = {**dict(enumerate(ALPHABET)), **{len(ALPHABET) + k: s for k, s in enumerate(SPECIALS)}}
        self.eod = len(ALPHABET)

    def vocabulary(self):
        return self.vocab

    def encode(self, text):
        ids = {s: i for i, s in self.vocab.items()}
        return [ids[piece] for piece in re.findall("|".join(map(re.escape, SPECIALS)) + "|.", text, re.S)]

    def decode(self, ids):
        return "".join(self.vocab[int(i)] for i in ids)

    # Megatron-LM's names for the same two calls
    text_to_ids = encode
    ids_to_text = decode


def megatron_fim(checkout: str, tok: CharTokenizer, fim: FIMSection):
    """A function (tokens, RandomState) -> tokens running Megatron-LM's GPTFIMDataset sample code."""
    if checkout not in sys.path:
        sys.path.append(checkout)  # `megatron` is a namespace package: core stays the installed one
    from megatron.training.datasets.fim_dataset import GPTFIMDataset

    ids = fim_ids(tok, fim)
    ds = GPTFIMDataset.__new__(GPTFIMDataset)  # no index files: the attributes its sample code reads
    ds.config = SimpleNamespace(tokenizer=SimpleNamespace(_tokenizer=tok))
    ds.fim_rate, ds.fim_spm_rate, ds.fragment_fim_rate = fim.rate, fim.spm_rate, fim.fragment_rate
    ds.fim_split_sample, ds.no_fim_prefix = ids.split, fim.no_prefix
    ds.prefix_tok_id, ds.middle_tok_id, ds.suffix_tok_id, ds.pad_tok_id, ds.eod_tok_id = (
        ids.prefix, ids.middle, ids.suffix, ids.pad, ids.eod)

    def run(tokens: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        ds.np_rng = rng
        ds.shuffle_index, ds.document_index = np.array([0]), np.array([0])
        ds.sample_index = np.array([[0, 0], [0, len(tokens) - 1]])
        ds.dataset = SimpleNamespace(get=lambda doc, offset=0, length=None: tokens[offset:offset + length])
        return ds._query_document_sample_shuffle_indices(0)[0]

    return run


def random_sample(rng: np.random.RandomState, tok: CharTokenizer, length: int) -> np.ndarray:
    """Characters with EOD and split tokens sprinkled in (runs of them and ones at the ends included)."""
    eod, split = tok.eod, tok.eod + SPECIALS.index("<|file|>")
    draw = rng.choice(len(ALPHABET) + 2, size=length, p=[0.85 / len(ALPHABET)] * len(ALPHABET) + [0.08, 0.07])
    return np.where(draw == len(ALPHABET), eod, np.where(draw == len(ALPHABET) + 1, split, draw)).astype(np.int64)


SETTINGS = {
    "psm": dict(rate=1.0, spm_rate=0.0),
    "spm": dict(rate=1.0, spm_rate=1.0),
    "mixed": dict(rate=0.5, spm_rate=0.5),
    "split_sample": dict(rate=0.9, spm_rate=0.5, split_sample="<|file|>", fragment_rate=0.6),
    "no_prefix": dict(rate=0.9, spm_rate=0.5, split_sample="<|file|>", fragment_rate=0.8, no_prefix="a"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", required=True, help="a Megatron-LM checkout (core_v0.16.1)")
    parser.add_argument("--samples", type=int, default=1000)
    args = parser.parse_args()
    tok = CharTokenizer()
    inputs = np.random.RandomState(0)
    total = same_total = 0
    for name, fields in SETTINGS.items():
        fim = FIMSection(**fields)
        reference, ids = megatron_fim(args.megatron, tok, fim), fim_ids(tok, fim)
        same = 0
        for n in range(args.samples):
            tokens = random_sample(inputs, tok, int(inputs.randint(8, 80)))
            theirs = reference(tokens.copy(), np.random.RandomState(n))
            ours = fim_sample(tokens.copy(), np.random.RandomState(n), fim=fim, tokenizer=tok, ids=ids)
            same += theirs.tolist() == ours.tolist()
        print(f"{name:13s} {same} of {args.samples} samples identical")
        total, same_total = total + args.samples, same_total + same
    print(f"{'all':13s} {same_total} of {total} samples identical")


if __name__ == "__main__":
    main()
