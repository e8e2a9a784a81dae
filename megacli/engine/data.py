"""Indexed datasets, blends and splits -> per-rank micro-batch iterators.

Every rank reads its own micro-batches (no broadcast): sample k of step s is the same sample in
every layout, because batches are cut from one global order exactly like Megatron's pretraining
sampler: micro-batch j of data-parallel rank d takes samples [j·mb·DP + d·mb, j·mb·DP + (d+1)·mb).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from megacli.errors import UserError


@dataclass
class DatasetTokenizer:
    """The little Megatron's datasets need from a tokenizer (ids of specials, vocab size)."""

    vocab_size: int
    eod: int
    pad: int | None = None
    unique_identifiers: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Splits:
    train: object
    valid: object | None
    test: object | None


def is_built_on_rank() -> bool:
    return True  # every rank reads its own batches; Megatron builds the index caches on rank 0 first


def build_gpt_datasets(*, data, seq_length: int, seed: int, tokenizer, train_samples: int, valid_samples: int,
                       cache_dir: str) -> Splits:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    ds_tok = DatasetTokenizer(vocab_size=tokenizer.vocab_size, eod=tokenizer.eod, pad=getattr(tokenizer, "pad", None),
                              unique_identifiers={"class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size})
    if data.mock:
        blend = None
    elif data.path:
        blend = ([data.path], None)
    else:
        blend = ([p for _, p in data.blend], [w for w, _ in data.blend])
    if blend is not None:
        check_vocabulary(blend[0], tokenizer.vocab_size)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=data.split,
        path_to_cache=cache_dir,
        tokenizer=ds_tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    cls = MockGPTDataset if data.mock else GPTDataset
    train, valid, test = BlendedMegatronDatasetBuilder(cls, [train_samples, valid_samples, 0], is_built_on_rank, config).build()
    if train is None:
        raise UserError(f"data.split = {data.split!r} leaves no training documents")
    return Splits(train, valid, test)


def check_vocabulary(prefixes: list[str], vocab_size: int, sample_docs: int = 2000) -> None:
    """Token ids in the data must fit the tokenizer's vocabulary (catches data built with another
    tokenizer). Reads the first and last documents only, so it is cheap on any corpus."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in prefixes:
        ds = IndexedDataset(prefix, mmap=True)
        n = len(ds)
        if n == 0:
            raise UserError(f"data prefix {prefix!r} holds no documents")
        idx = list(range(min(n, sample_docs // 2))) + list(range(max(0, n - sample_docs // 2), n))
        top = max(int(np.max(ds[i])) if len(ds[i]) else 0 for i in idx)
        if top >= vocab_size:
            raise UserError(f"data prefix {prefix!r} contains token id {top}, but the tokenizer has {vocab_size} ids: "
                            f"the data was built with another tokenizer (rebuild it with `megacli preprocess` and this tokenizer)")


def micro_batches(dataset, *, start_sample: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                  device) -> Iterator[dict]:
    """Endless micro-batches for one data-parallel rank, starting at global sample ``start_sample``."""
    step = micro_batch_size * dp_size
    first = start_sample
    n = len(dataset)
    while True:
        lo = first + dp_rank * micro_batch_size
        samples = [dataset[(lo + j) % n] for j in range(micro_batch_size)]
        batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0] if k != "attention_mask"}
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        first += step


def cache_dir_for(data, run_dir: str) -> str:
    return data.cache_dir or str(Path(run_dir) / "data_cache")
