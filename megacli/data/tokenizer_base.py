"""The interface every tokenizer offers (``tokenizers`` holds the kinds and ``load_tokenizer``)."""

from __future__ import annotations

from itertools import chain
from typing import Iterable, Optional

import numpy as np


class Tokenizer:
    """What every tokenizer offers. Special ids are None where the tokenizer has no such token."""

    vocab_size: int
    eod: int
    bos: Optional[int] = None
    pad: Optional[int] = None
    cls: Optional[int] = None
    sep: Optional[int] = None
    mask: Optional[int] = None
    name: str = ""

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """encode_batch as arrays: every text's ids back to back, and each text's id count."""
        seqs = self.encode_batch(texts)
        lengths = np.fromiter(map(len, seqs), np.int64, len(seqs))
        return np.fromiter(chain.from_iterable(seqs), np.int64, int(lengths.sum())), lengths

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def vocabulary(self) -> dict[int, str]:
        """Every id's token string (BERT/T5 masking reads word pieces and random tokens from it)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} vocab_size={self.vocab_size} eod={self.eod}>"
