"""Training data without a preprocessing step: documents read from JSONL files or a Hugging Face
dataset, tokenized in the background and packed into samples of seq_length + 1 tokens.

Packing is Megatron's GPTDataset's without shuffling: the documents (each followed by EOD, as
`megacli preprocess` writes them) are concatenated in order and sample k is tokens
[k·seq_length, (k+1)·seq_length + 1) of that stream, so consecutive samples share one token. When a
source runs out it starts over (another epoch), as GPTDataset's document index repeats.

Sharding: document i of a source goes to data-parallel rank i mod DP, which packs its own
documents. A rank's position is (documents of its shard consumed, tokens of the next one already
used): a resume skips those documents untokenized and continues with the next unseen token.
"""

from __future__ import annotations

import glob
import json
import queue
import threading
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator

import numpy as np

from megacli.errors import UserError
from megacli.filekind import not_regular
from megacli.paths import shown

AHEAD = 4  # batches of documents being tokenized ahead of training
BATCH_DOCS = 64


@dataclass(frozen=True)
class TokenizerSpec:
    """How a worker process builds the run's tokenizer (tokenizers are rebuilt, not pickled)."""

    type: str
    path: str | None
    vocab_size: int | None


# ------------------------------------------------------------------------------ reading documents


def jsonl_paths(patterns: list[str]) -> list[Path]:
    """The files a jsonl source reads: each pattern's matches sorted, in the order the patterns are given."""
    paths = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not found:
            raise UserError(f"data.files: {shown(pattern)} matches no file")
        for name in found:
            problem = not_regular(name)
            if problem is not None:
                raise UserError(f"data.files: {shown(name)}: {'file not found' if problem == 'no such file' else problem}")
            paths.append(Path(name))
    return paths


def _jsonl_texts(paths: list[Path], field: str) -> Iterator[str]:
    from megacli.data.jsonl import iter_lines

    for path in paths:
        for where, record in iter_lines(path):
            yield _text_of(record, field, where)


def _text_of(record, field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise UserError(f"{where}: not a JSON object (a record with a {field!r} field)")
    if field not in record:
        raise UserError(f"{where}: no text field {field!r} (set data.text_field)")
    text = record[field]
    if not isinstance(text, str):
        raise UserError(f"{where}: field {field!r} is {type(text).__name__} {_short(text)}, not a string")
    return text


def _short(value) -> str:
    shown = json.dumps(value, ensure_ascii=False)
    return shown if len(shown) <= 40 else shown[:37] + "..."


HF_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}


def open_hf(source):
    """The `datasets` dataset a hf source names: a load_from_disk directory, data files of a known
    extension (read with that builder), or a dataset name / script directory."""
    import datasets

    name = source.name
    local = Path(name)
    try:
        saved = local.is_dir() and any((local / f).is_file() for f in ("dataset_info.json", "dataset_dict.json"))
        if saved:  # written by save_to_disk
            ds = datasets.load_from_disk(name)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[source.hf_split]
            return ds.to_iterable_dataset() if source.streaming else ds
        files = hf_files(name)
        if files:
            builder = HF_BUILDERS[Path(files[0]).suffix]
            return datasets.load_dataset(builder, data_files=files, split=source.hf_split, streaming=source.streaming)
        if "/" in name and (name.startswith((".", "/", "~")) or local.parent.exists()):
            raise UserError(f"data.name {shown(name)}: no such file or directory")
        return datasets.load_dataset(name, source.config, split=source.hf_split, streaming=source.streaming)
    except UserError:
        raise
    except Exception as e:  # datasets raises many kinds (missing, offline, bad config)
        raise UserError(f"data.name {name!r}: cannot open the dataset ({type(e).__name__}: {e})") from None


def hf_files(name: str) -> list[str]:
    """The data files a hf source's name stands for (a file, or a glob's matches, of a type in
    HF_BUILDERS); [] for a dataset name or a directory."""
    if glob.has_magic(name):
        files = sorted(glob.glob(name))
        if not files:
            raise UserError(f"data.name {name!r}: matches no file")
    elif Path(name).is_file():
        files = [name]
    else:
        return []
    unknown = next((f for f in files if Path(f).suffix not in HF_BUILDERS), None)
    if unknown is not None:
        raise UserError(f"data.name {name!r}: {unknown}: unknown file type (give {', '.join(HF_BUILDERS)} files)")
    return files


def check_sources(recipe) -> None:
    """What can be known of on-the-fly data before any worker starts (the launcher and --dry-run
    check it): every jsonl pattern and hf file glob matches files, a jsonl source has a document
    with text, and data.fim's tokens exist."""
    for source in recipe.data.stream_sources():
        if source.source == "jsonl":
            jsonl_paths(source.files)
            check_has_text(source)
        else:
            hf_files(source.name)
    if recipe.data.fim is not None:
        from megacli.data.fim import fim_ids
        from megacli.data.tokenizers import load_tokenizer

        tok = recipe.tokenizer
        fim_ids(load_tokenizer(type=tok.type, path=tok.path, vocab_size=recipe.model.vocab_size), recipe.data.fim)


def _hf_texts(source) -> Iterator[str]:
    for n, record in enumerate(open_hf(source)):
        yield _text_of(record, source.text_field, f"data.name {source.name!r} record {n}")


def texts(source) -> Iterator[str]:
    """One pass over a source's document texts."""
    if source.source == "jsonl":
        return _jsonl_texts(jsonl_paths(source.files), source.text_field)
    return _hf_texts(source)


def _where(source) -> str:
    return f"on-the-fly data {source.files if source.source == 'jsonl' else source.name!r}"


def _all_empty(source, documents: int, whose: str = "") -> UserError:
    """Empty documents give no tokens (not even EOD): packing would wait for tokens forever."""
    return UserError(f"{_where(source)}: all {documents} documents{whose} have an empty {source.text_field!r}: "
                     f"nothing to train on")


def shard_texts(source, *, rank: int, world: int) -> Iterator[str]:
    """This rank's documents (i mod world == rank), pass after pass, without end."""
    i = 0
    while True:
        mine = with_text = 0
        for text in texts(source):
            if i % world == rank:
                mine += 1
                with_text += bool(text)
                yield text
            i += 1
        if not mine:
            raise UserError(f"{_where(source)}: no document for data-parallel rank {rank} of {world} "
                            f"({i} documents in all)")
        if not with_text:
            raise _all_empty(source, mine, f" of data-parallel rank {rank} of {world}" if world > 1 else "")


def check_has_text(source) -> None:
    """Refuse a jsonl source without a document that has text (read up to the first that has some;
    hf sources are checked as they are read: opening one may download it)."""
    if source.source != "jsonl":
        return
    documents = 0
    for text in texts(source):
        if text:
            return
        documents += 1
    raise _all_empty(source, documents)


# ------------------------------------------------------------------------------ noticing a changed source

EDGE_BYTES = 1 << 20  # a file's first and last MiB are hashed


def _file_print(path: Path) -> dict:
    import xxhash

    size = path.stat().st_size
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        digest.update(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            digest.update(f.read())
    return {"path": str(path), "size": size, "edges_xxh3": digest.hexdigest()}


def _local_files(source) -> list[Path]:
    """The local files a source reads, in order (none for a dataset named on the Hub)."""
    if source.source == "jsonl":
        return jsonl_paths(source.files)
    name = Path(source.name)
    if name.is_dir():
        return sorted(p for p in name.rglob("*") if p.is_file())
    return [Path(f) for f in (sorted(glob.glob(source.name)) if glob.has_magic(source.name) else [source.name])
            if Path(f).is_file()]


def fingerprint(source) -> dict:
    """What a checkpoint keeps of a source to notice that it changed: what is read (kind, name,
    split, text field) and each local file's path, size and xxh3-64 of its first and last MiB.
    Replacing, truncating, appending to or reordering files changes it; the modification time is
    left out (a copy or a restore changes it, not the documents), and the whole file is not hashed
    (a large corpus would be read at every start). A dataset named on the Hub is known by its name."""
    read = {k: getattr(source, k) for k in ("source", "name", "config", "hf_split", "text_field")}
    return {"read": read, "files": [_file_print(p) for p in _local_files(source)]}


def change(saved: dict, now: dict) -> str | None:
    """How a source's fingerprint differs from the saved one (None: the same documents)."""
    files = saved.get("files") if isinstance(saved, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        return "the checkpoint's record of it is unreadable"
    if saved.get("read") != now["read"]:
        return f"it reads {now['read']}, the checkpoint's read {saved.get('read')}"
    before, after = files, now["files"]
    for old, new in zip(before, after):
        if (old.get("size"), old.get("edges_xxh3")) != (new["size"], new["edges_xxh3"]):
            return (f"{new['path']} differs from the file read then ({old.get('path')}: "
                    f"{old.get('size')} bytes, now {new['size']})")
    if len(before) != len(after):
        return f"it has {len(after)} files, the checkpoint's had {len(before)}"
    return None


# ------------------------------------------------------------------------------ tokenizing ahead

_worker_tokenizer = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_tokenizer
    from megacli.data.tokenizers import load_tokenizer

    _worker_tokenizer = load_tokenizer(type=spec.type, path=spec.path, vocab_size=spec.vocab_size)


def _encode(batch: list[str]) -> list[np.ndarray]:
    """A document's tokens followed by EOD; an empty document has none (as preprocess writes)."""
    tok = _worker_tokenizer
    out = []
    for ids in tok.encode_batch(batch):
        out.append(np.asarray([*ids, tok.eod] if ids else [], dtype=np.int64))
    return out


class Tokenized:
    """Token arrays of an endless document iterator, tokenized ahead in a background thread (and,
    with workers > 0, a process pool), at most AHEAD batches ahead."""

    def __init__(self, docs: Iterator[str], *, spec: TokenizerSpec, workers: int):
        self._queue: queue.Queue = queue.Queue(maxsize=AHEAD)
        self._stop = threading.Event()
        self._pool = None
        if workers:
            import multiprocessing as mp

            self._pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(spec,))
        else:
            _init_worker(spec)
        self._thread = threading.Thread(target=self._fill, args=(docs,), daemon=True)
        self._thread.start()
        self._current: Iterator[np.ndarray] = iter(())

    def _fill(self, docs: Iterator[str]) -> None:
        try:
            while not self._stop.is_set():
                batch = list(islice(docs, BATCH_DOCS))
                job = self._pool.apply_async(_encode, (batch,)) if self._pool else _encode(batch)
                self._put(("ok", job))
        except BaseException as e:  # handed to the training thread, which raises it
            self._put(("error", e))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        while True:
            for tokens in self._current:
                return tokens
            kind, job = self._queue.get()
            if kind == "error":
                raise job
            self._current = iter(job.get() if self._pool else job)

    def close(self) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.terminate()


# ------------------------------------------------------------------------------ packing


@dataclass(frozen=True)
class Position:
    """Where a rank's next sample starts: `offset` tokens into document `documents` of its shard."""

    documents: int = 0
    offset: int = 0


def pack(docs: Iterator[np.ndarray], *, seq_length: int, start: Position) -> Iterator[tuple[np.ndarray, Position]]:
    """Samples of seq_length + 1 tokens cut from the documents' concatenation (the first
    ``start.documents`` already skipped by the caller), each with the position after it."""
    pending: list[np.ndarray] = []  # token arrays not fully used, the first starting at `position`
    have = 0
    doc, offset = start.documents, start.offset
    first = True
    while True:
        while have < seq_length + 1:
            tokens = next(docs)
            if first:
                tokens, first = tokens[offset:], False
            pending.append(tokens)
            have += len(tokens)
        sample = np.concatenate(pending)[:seq_length + 1]
        drop = seq_length
        while drop:  # move the start on by seq_length tokens: the sample's last token starts the next one
            head = pending[0]
            if len(head) <= drop:
                pending.pop(0)
                drop -= len(head)
                have -= len(head)
                doc, offset = doc + 1, 0
            else:
                pending[0] = head[drop:]
                have -= drop
                offset += drop
                drop = 0
        while pending and not len(pending[0]):  # empty documents hold no position
            pending.pop(0)
            doc, offset = doc + 1, 0
        yield sample, Position(doc, offset)


def blend_choice(weights: list[float], n: int, counts: list[int]) -> int:
    """Megatron's blending order (helpers.build_blending_indices): sample n comes from the source
    furthest behind its share."""
    errors = [w * max(n, 1) - c for w, c in zip(weights, counts)]
    return int(np.argmax(errors))


def normalized(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


class RankStream:
    """One data-parallel rank's samples (seq_length + 1 token arrays) from a weighted mixture of
    sources, resumable from ``state()``: samples drawn and each source's Position."""

    def __init__(self, sources: list, *, spec: TokenizerSpec, seq_length: int, rank: int, world: int,
                 workers: int, state: dict | None = None):
        state = state or {}
        self.weights = normalized([s.weight for s in sources])
        self.samples = int(state.get("samples", 0))
        self.counts = [0] * len(sources)
        for n in range(self.samples):  # the blend's per-source counts follow from the sample count
            self.counts[blend_choice(self.weights, n, self.counts)] += 1
        starts = [Position(**p) for p in state.get("positions", [{}] * len(sources))]
        if len(starts) != len(sources):
            raise UserError(f"the checkpoint's stream position has {len(starts)} sources; data.sources has {len(sources)}")
        self.positions = list(starts)
        self._tokenized = []
        self._packers = []
        for source, start in zip(sources, starts):
            docs = islice(shard_texts(source, rank=rank, world=world), start.documents, None)
            tokenized = Tokenized(docs, spec=spec, workers=workers)
            self._tokenized.append(tokenized)
            self._packers.append(pack(tokenized, seq_length=seq_length, start=start))

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        i = blend_choice(self.weights, self.samples, self.counts)
        sample, self.positions[i] = next(self._packers[i])
        self.counts[i] += 1
        self.samples += 1
        return sample

    def state(self) -> dict:
        """What a checkpoint keeps to continue with the next unseen token."""
        return {"samples": self.samples, "positions": [{"documents": p.documents, "offset": p.offset}
                                                       for p in self.positions]}

    def close(self) -> None:
        for t in self._tokenized:
            t.close()
