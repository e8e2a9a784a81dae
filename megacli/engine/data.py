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

from megacli.data.indexed import validate
from megacli.data.tokenizers import SENTINEL
from megacli.engine.array_files import not_plain_array
from megacli.engine.batches import to_device
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


def build_megatron_splits(cls, sizes: list, config) -> tuple:
    """Megatron-Core's BlendedMegatronDatasetBuilder, its index cache checked first."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    if config.path_to_cache:
        check_index_cache(Path(config.path_to_cache))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank has checked before rank 0 starts writing new index files
    return BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()


def check_index_cache(cache_dir: Path) -> None:
    """Refuse a cached index that is not a plain numpy array file: Megatron-Core loads them with
    ``numpy.load(allow_pickle=True)``, so a pickle saved under a cache file's name would run code."""
    for path in sorted(cache_dir.glob("*.npy")) if cache_dir.is_dir() else []:
        problem = not_plain_array(path)
        if problem:
            raise UserError(f"{path}: {problem}, not an index Megatron-Core could have written; loading it could run "
                            f"code. Delete it (the index is rebuilt) or use another data.cache_dir")


def megatron_blend(data) -> tuple[list[str], list[float] | None]:
    """The data section as Megatron's blend: (prefixes, weights); weights None for one dataset."""
    if data.path:
        return [data.path], None
    return data.prefixes, [w for w, _ in data.blend]


def is_built_on_rank() -> bool:
    return True  # every rank reads its own batches; Megatron builds the index caches on rank 0 first


def stream_data(*, data, tokenizer_section, tokenizer, vocab_size: int | None, seq_length: int, seed: int):
    """On-the-fly training data (data.source jsonl/hf or data.sources): read, tokenized and packed while training."""
    from megacli.data.fim import fim_ids
    from megacli.data.stream import TokenizerSpec
    from megacli.engine.stream_data import StreamData

    spec = TokenizerSpec(type=tokenizer_section.type, path=tokenizer_section.path, vocab_size=vocab_size)
    ids = fim_ids(tokenizer, data.fim) if data.fim is not None else None  # missing FIM tokens fail before training
    return StreamData(data=data, spec=spec, tokenizer=tokenizer, seq_length=seq_length, seed=seed, fim_ids=ids)


def build_gpt_datasets(*, data, seq_length: int, seed: int, tokenizer, train_samples: int, valid_samples: int,
                       cache_dir: str) -> Splits:
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    ds_tok = DatasetTokenizer(vocab_size=tokenizer.vocab_size, eod=tokenizer.eod, pad=getattr(tokenizer, "pad", None),
                              unique_identifiers={"class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size})
    blend = None if data.mock else megatron_blend(data)
    if blend is not None:
        check_splits(blend[0], data.split, min_tokens=seq_length + 1)
        check_vocabulary(blend[0], tokenizer.vocab_size)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=data.split,
        path_to_cache=cache_dir,
        tokenizer=ds_tok,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=False,  # refused for indexed data by the recipe (the batches carry no mask)
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    cls = MockGPTDataset if data.mock else GPTDataset
    train, valid, test = build_megatron_splits(cls, [train_samples, valid_samples, 0], config)
    if train is None:
        raise UserError(f"data.split = {data.split!r} leaves no training documents")
    for split in (train, valid, test):
        own_masks_per_sample(split)
    return Splits(train, valid, test)


def own_masks_per_sample(dataset) -> None:
    """Megatron-Core 0.16.1's GPTDataset caches the loss mask of the first sample it reads after
    zeroing that sample's pad labels in place (the cache is the same tensor), so every later sample
    is also masked where the first one had pads, and a resumed run, whose first sample differs,
    masks differently. Filling the cache before any read, with what Megatron computes for the
    cacheable case (no resets, no EOD masking: a mask of ones, positions 0..s-1, whatever the
    tokens), leaves each sample only its own pads masked."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, _get_ltor_masks_and_position_ids

    for part in getattr(dataset, "datasets", [dataset]):  # a BlendedDataset holds its GPTDatasets
        if not isinstance(part, GPTDataset) or not part.masks_and_position_ids_are_cacheable:
            continue
        c = part.config
        (part.cached_attention_mask, part.cached_loss_mask, part.cached_position_ids) = _get_ltor_masks_and_position_ids(
            torch.zeros(c.sequence_length, dtype=torch.long), c.tokenizer.eod, c.reset_position_ids,
            c.reset_attention_mask, c.eod_mask_loss, c.create_attention_mask)
        part.masks_and_position_ids_are_cached = True


# ---------------------------------------------------------------- named validation sets


def named_validation_sets(*, data, sft, train, preference=None, tokenizer, tokenizer_path: str | None, seq_length: int,
                          cache_dir: str) -> dict[str, "ScoredSamples"]:
    """data.valid (or, finetuning, sft.valid as a map): name -> what each evaluation scores of that
    set: its first train.eval_iters global batches of samples, or all of them when it holds fewer."""
    if preference is not None:
        from megacli.data.preference import build_preference_named_sets

        sets, notes = build_preference_named_sets(pref=preference, tokenizer=tokenizer, tokenizer_path=tokenizer_path,
                                                  seq_length=seq_length)
    elif sft is not None:
        from megacli.data.sft import build_sft_named_sets

        sets, notes = build_sft_named_sets(sft=sft, tokenizer=tokenizer, tokenizer_path=tokenizer_path,
                                           seq_length=seq_length)
    else:
        sets = build_named_gpt_sets(sets=data.named_valid, seq_length=seq_length, tokenizer=tokenizer, cache_dir=cache_dir)
        notes = [f"validation set {name}: {len(ds)} samples of {seq_length} tokens, in file order"
                 for name, ds in sets.items()]
    samples = train.eval_iters * train.global_batch_size
    return {name: ScoredSamples(ds, samples=samples, global_batch_size=train.global_batch_size, note=note)
            for (name, ds), note in zip(sets.items(), notes)}


def build_named_gpt_sets(*, sets: dict[str, str], seq_length: int, tokenizer, cache_dir: str) -> dict:
    """data.valid: name -> the whole dataset of its prefix as Megatron's validation split (split
    0,1,0 through BlendedMegatronDatasetBuilder), its samples in file order."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    ds_tok = DatasetTokenizer(vocab_size=tokenizer.vocab_size, eod=tokenizer.eod, pad=getattr(tokenizer, "pad", None),
                              unique_identifiers={"class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size})
    out = {}
    for name, prefix in sets.items():
        tokens = int(validate(prefix).document_lengths().sum())
        if tokens < seq_length + 1:
            raise UserError(f"data.valid.{name} = {prefix!r} holds {tokens:,} tokens; one sample needs "
                            f"model.seq_length + 1 = {seq_length + 1:,}")
        check_vocabulary([prefix], tokenizer.vocab_size)
        config = GPTDatasetConfig(random_seed=0, sequence_length=seq_length, blend=([prefix], None), split="0,1,0",
                                  path_to_cache=cache_dir, tokenizer=ds_tok, reset_position_ids=False,
                                  reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
                                  mmap_bin_files=True)
        _, valid, _ = build_megatron_splits(sequential_gpt_dataset_class(), [0, None, 0], config)
        own_masks_per_sample(valid)
        out[name] = valid
    return out


def sequential_gpt_dataset_class():
    """Megatron-Core's GPTDataset over one epoch of its documents in file order, samples unshuffled:
    sample k is tokens [k·s, (k+1)·s] of the documents laid end to end (s = sequence length), so
    what a named validation set scores does not depend on a seed."""
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import GPTDataset

    class SequentialGPTDataset(GPTDataset):
        def _build_document_sample_shuffle_indices(self):
            documents = np.asarray(self.indices, dtype=np.int32)
            sample_index = helpers.build_sample_idx(self.dataset.sequence_lengths, documents, self.config.sequence_length,
                                                    1, self._get_num_tokens_per_epoch(), True,
                                                    self.config.add_extra_token_to_sequence)
            return documents, sample_index, np.arange(len(sample_index) - 1, dtype=np.int64)

    return SequentialGPTDataset


class ScoredSamples:
    """The first ``samples`` samples of a dataset (all of them when it holds fewer), as whole
    global batches: a last partial batch is filled with copies of sample 0 whose loss mask is zero,
    so every sample counts exactly once in the mean token loss. ``batches``: global batches to run."""

    def __init__(self, dataset, *, samples: int, global_batch_size: int, note: str = ""):
        self.dataset = dataset
        self.scored = min(samples, len(dataset))
        self.batches = -(-self.scored // global_batch_size)
        self.length = self.batches * global_batch_size
        self.summary = f"{note}; each evaluation scores {self.scored} of them ({self.batches} global batches)"

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        if i < self.scored:
            return self.dataset[i]
        filler = dict(self.dataset[0])
        filler["loss_mask"] = np.zeros_like(np.asarray(filler["loss_mask"]))
        return filler


# ---------------------------------------------------------------- BERT and T5 (masked WordPiece datasets)



class MegatronTokenizer:
    """Our tokenizer as Megatron-Core's BERT/T5 datasets read a tokenizer (Megatron-LM's legacy
    ``BertWordPiece*`` interface): cls, sep, mask, pad, bos, eos, eod, vocab_size, inv_vocab,
    additional_special_tokens_ids, unique_identifiers.

    * Sentinels (``sentinels`` > 0, T5): ``<extra_id_0>``, ``<extra_id_1>``, ... - the tokenizer's own
      when it has them, else appended after its vocabulary, as Megatron-LM's ``vocab_extra_ids``;
      ``vocab_size`` counts them.
    * ``inv_vocab`` writes word continuations as WordPiece does (``##piece``), which is what the
      datasets' whole-word masking looks for: WordPiece vocabularies already do; SentencePiece pieces
      that do not start a word (no leading ``▁``) get the prefix. Other tokenizers mark no word
      pieces, so every token is a word of its own there (``whole_word_masking`` says which).
    * ``pad`` is never 1: Megatron's BERT dataset writes the pad id into its padding mask (1 =
      token), so a pad id of 1 (or none) is given as -1, Megatron's "no pad token"; the engine
      reads the mask as ``== 1`` and never looks up a padded position's token type.
    """

    def __init__(self, tokenizer, *, sentinels: int = 0):
        self.tokenizer = tokenizer
        vocab = tokenizer.vocabulary()
        ids = {t: i for i, t in vocab.items()}
        size = tokenizer.vocab_size
        self.additional_special_tokens_ids = []
        for k in range(sentinels):
            tok = SENTINEL.format(k)
            if tok not in ids:
                ids[tok], vocab[size] = size, tok
                size += 1
            self.additional_special_tokens_ids.append(ids[tok])
        self.vocab_size = size
        self.whole_word_masking = any(t.startswith("##") for t in vocab.values())
        from megacli.data.tokenizers import SentencePieceTokenizer

        if not self.whole_word_masking and isinstance(tokenizer, SentencePieceTokenizer):
            vocab = {i: ("##" + t if _continues_word(t) else t) for i, t in vocab.items()}
            self.whole_word_masking = True
        self.inv_vocab = vocab
        self.vocab = ids
        self.cls, self.sep, self.mask = tokenizer.cls, tokenizer.sep, tokenizer.mask
        self.bos, self.eod = tokenizer.bos, tokenizer.eod
        self.eos = tokenizer.eod
        self.pad = tokenizer.pad if tokenizer.pad not in (None, 1) else -1
        self.unique_identifiers = {"class": type(tokenizer).__name__, "name": tokenizer.name,
                                   "vocab_size": self.vocab_size, "sentinels": sentinels}

    def require(self, arch: str) -> None:
        """Fail with a message naming what a BERT/T5 dataset needs and this tokenizer lacks."""
        needed = {"bert": ("cls", "sep", "mask"), "t5": ("bos", "eos")}[arch]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise UserError(f"tokenizer {self.tokenizer.name!r} has no {', '.join(missing)} token: {arch} samples need "
                            f"{', '.join(needed)} (a BERT WordPiece vocab.txt has them: python data_tools/train_wordpiece.py)")


def _continues_word(piece: str) -> bool:
    """A SentencePiece piece inside a word: no word-start marker, not a control/byte piece like <s>."""
    return not piece.startswith("\u2581") and not (piece.startswith("<") and piece.endswith(">"))


def masked_dataset_classes():
    """Megatron-Core's BERT and T5 datasets, refusing data that cannot give a sample. Megatron's
    sample mapping (helpers.build_mapping) loops over its epoch budget - billions of epochs - when
    no document of a split qualifies, so such a split would hang instead of failing."""
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset

    class BertDataset(BERTMaskedWordPieceDataset):
        def _build_sample_index(self, sequence_length, min_sentences_per_sample):
            _check_samples_possible(self, min_sentences_per_sample, "bert")
            return super()._build_sample_index(sequence_length, min_sentences_per_sample)

    class T5Dataset(T5MaskedWordPieceDataset):
        def _build_sample_index(self, sequence_length, min_sentences_per_sample):
            _check_samples_possible(self, min_sentences_per_sample, "t5")
            return super()._build_sample_index(sequence_length, min_sentences_per_sample)

    return {"bert": BertDataset, "t5": T5Dataset}


LONG_SENTENCE = 512  # helpers.cpp LONG_SENTENCE_LEN: documents of several sentences with a longer one are skipped


def _check_samples_possible(ds, min_sentences: int, arch: str) -> None:
    docs = np.asarray(ds.dataset.document_indices)
    sizes = np.asarray(ds.dataset.sequence_lengths)
    for doc in np.asarray(ds.indices):
        first, last = int(docs[doc]), int(docs[doc + 1])
        n = last - first
        if n >= min_sentences and (n <= 1 or int(sizes[first:last].max()) <= LONG_SENTENCE):
            return
    why = (f"no document of at least {min_sentences} sentences (each at most {LONG_SENTENCE} tokens)"
           if min_sentences > 1 else "no non-empty document")
    hint = (" - build sentence-split data with `megacli preprocess --split-sentences` (PREFIX_text_sentence)"
            if min_sentences > 1 else "")
    raise UserError(f"{arch} data {ds.dataset_path!r}, {ds.index_split.name} split ({len(ds.indices)} documents): {why}, "
                    f"so it gives no sample{hint}; or adjust data.split")


def build_masked_datasets(*, arch: str, data, masking, seq_length: int, decoder_seq_length: int, binary_head: bool,
                          seed: int, tokenizer: MegatronTokenizer, train_samples: int, valid_samples: int,
                          cache_dir: str) -> Splits:
    """Megatron-Core's BERTMaskedWordPieceDataset (masked LM + sentence order) or
    T5MaskedWordPieceDataset (span corruption) over sentence-split indexed datasets."""
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDatasetConfig

    tokenizer.require(arch)
    blend = megatron_blend(data)
    for prefix in blend[0]:  # empty splits are refused by _check_samples_possible, naming the sentence rule
        validate(prefix)
    check_vocabulary(blend[0], tokenizer.tokenizer.vocab_size)
    common = dict(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=data.split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        mmap_bin_files=True,
        masking_probability=masking.probability,
        short_sequence_probability=masking.short_sequence_probability,
        masking_max_ngram=masking.ngram(arch),
        masking_do_full_word=masking.whole_word and tokenizer.whole_word_masking,  # needs marked word pieces
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=masking.geometric(arch),
    )
    if arch == "bert":
        config = BERTMaskedWordPieceDatasetConfig(classification_head=binary_head, **common)
    else:
        config = T5MaskedWordPieceDatasetConfig(sequence_length_decoder=decoder_seq_length, **common)
    cls = masked_dataset_classes()[arch]
    train, valid, test = build_megatron_splits(cls, [train_samples, valid_samples, 0], config)
    if train is None:
        raise UserError(f"data.split = {data.split!r} leaves no training documents")
    return Splits(train, valid, test)

def check_splits(prefixes: list[str], split: str, *, min_tokens: int) -> None:
    """Validate each dataset's files, then give every split with a share of data.split at least one
    document and ``min_tokens`` tokens. Megatron builds every such split (even one no sample is drawn
    from) and loops forever looking for the tokens of an empty one."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for prefix in prefixes:
        index = validate(prefix)
        n = index.document_count
        tokens = np.concatenate([[0], np.cumsum(index.document_lengths())])
        for name, bound in zip(("train", "validation", "test"), bounds):
            if bound is None:
                continue
            # Megatron's own rounding (BlendedMegatronDatasetBuilder._build_megatron_dataset_splits)
            beg, end = round(bound[0] * n), round(bound[1] * n)
            have = int(tokens[end] - tokens[beg])
            if end - beg < 1 or have < min_tokens:
                raise UserError(f"data prefix {prefix!r} ({n} documents, {int(tokens[-1]):,} tokens): data.split = "
                                f"{split!r} gives the {name} split {end - beg} documents and {have:,} tokens; it needs "
                                f"at least 1 document and {min_tokens:,} tokens. Use more data, or a split with "
                                f"a zero share for that split (e.g. '1,0,0')")


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
        yield to_device(batch, device)
        first += step


def cache_dir_for(data, run_dir: str) -> str:
    return data.cache_dir or str(Path(run_dir) / "data_cache")
