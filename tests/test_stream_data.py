"""On-the-fly data (data.source jsonl/hf): packing equals preprocess + GPTDataset, data-parallel
shards are disjoint and complete, a resume continues with the next unseen token (stream and a real
pretrain pair), weighted mixtures, fill-in-the-middle samples, recipe errors."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from megacli.data.stream import Position, RankStream, TokenizerSpec, Tokenized, pack, shard_texts
from megacli.recipe.data_sections import DataSection
from megacli.recipe.stream import StreamSource

BYTE = TokenizerSpec(type="byte", path=None, vocab_size=None)
SEQ = 16


def documents(n: int) -> list[str]:
    rng = np.random.RandomState(0)
    return ["".join(chr(97 + int(c)) for c in rng.randint(0, 26, size=int(rng.randint(1, 40)))) + f" doc{i}"
            for i in range(n)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def jsonl_source(path: Path, weight: float = 1.0) -> StreamSource:
    return StreamSource(source="jsonl", files=[str(path)], weight=weight)


def test_packing_equals_preprocess_and_gpt_dataset(tmp_path):
    from megacli.data.preprocess import Job, run
    from megacli.data.tokenizers import load_tokenizer
    from megacli.engine.data import build_gpt_datasets

    texts = documents(60)
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    run(Job(inputs=[str(corpus)], output_prefix=str(tmp_path / "c"), keys=["text"], tokenizer_type="byte",
            tokenizer_path=None, append_eod=True, workers=0, progress=False))
    data = DataSection(path=str(tmp_path / "c_text_document"), split="1,0,0")
    tok = load_tokenizer(type="byte", path=None)
    train = build_gpt_datasets(data=data, seq_length=SEQ, seed=3, tokenizer=tok, train_samples=40, valid_samples=0,
                               cache_dir=str(tmp_path / "cache")).train
    # GPTDataset shuffles documents and samples; read its samples in unshuffled order and give the
    # stream its documents in its (shuffled) document order.
    order = np.asarray(train.document_index)
    unshuffled = np.argsort(np.asarray(train.shuffle_index))
    ordered = iter([texts[i] for i in order])
    stream = pack(Tokenized(ordered, spec=BYTE, workers=0), seq_length=SEQ, start=Position())
    for j in range(len(unshuffled)):
        want, _ = train._query_document_sample_shuffle_indices(int(unshuffled[j]))
        got, _ = next(stream)
        assert got.tolist() == want.tolist(), f"sample {j}"
    assert len(unshuffled) >= 40


def test_data_parallel_shards_are_disjoint_and_complete(tmp_path):
    from megacli.data.tokenizers import load_tokenizer

    texts = documents(23)
    src = jsonl_source(write_jsonl(tmp_path / "c.jsonl", texts))
    shards = [list(islice(shard_texts(src, rank=r, world=2), n)) for r, n in ((0, 12), (1, 11))]
    assert sorted(shards[0] + shards[1]) == sorted(texts)
    assert not set(shards[0]) & set(shards[1])
    assert shards[0] == texts[0::2] and shards[1] == texts[1::2]
    # Token level: each rank's packed samples are its documents' tokens, in order.
    for r in (0, 1):
        stream = RankStream([src], spec=BYTE, seq_length=SEQ, rank=r, world=2, workers=0)
        samples = [next(stream) for _ in range(6)]
        stream.close()
        flat = np.concatenate([samples[0]] + [s[1:] for s in samples[1:]])
        tok = load_tokenizer(type="byte", path=None)
        want = np.concatenate([np.asarray(tok.encode(t) + [tok.eod]) for t in shards[r] + shards[r]])
        assert flat.tolist() == want[:len(flat)].tolist()


@pytest.mark.parametrize("workers", [0, 1])
def test_stream_resumes_with_the_next_unseen_token(tmp_path, workers):
    a = jsonl_source(write_jsonl(tmp_path / "a.jsonl", documents(15)), weight=3)
    b = jsonl_source(write_jsonl(tmp_path / "b.jsonl", [t.upper() for t in documents(9)]), weight=1)
    whole = RankStream([a, b], spec=BYTE, seq_length=SEQ, rank=1, world=2, workers=workers)
    expected = [next(whole).tolist() for _ in range(30)]
    whole.close()
    first = RankStream([a, b], spec=BYTE, seq_length=SEQ, rank=1, world=2, workers=workers)
    head = [next(first).tolist() for _ in range(13)]
    state = json.loads(json.dumps(first.state()))  # as megacli.json keeps it
    first.close()
    rest = RankStream([a, b], spec=BYTE, seq_length=SEQ, rank=1, world=2, workers=workers, state=state)
    tail = [next(rest).tolist() for _ in range(17)]
    rest.close()
    assert head + tail == expected
    assert 0 < state["positions"][0]["documents"] and state["samples"] == 13


def test_mixture_follows_the_weights(tmp_path):
    a = jsonl_source(write_jsonl(tmp_path / "a.jsonl", ["a" * 50] * 4), weight=3)
    b = jsonl_source(write_jsonl(tmp_path / "b.jsonl", ["b" * 50] * 4), weight=1)
    stream = RankStream([a, b], spec=BYTE, seq_length=SEQ, rank=0, world=1, workers=0)
    firsts = [chr(next(stream)[0]) for _ in range(40)]
    stream.close()
    assert firsts.count("a") == 30 and firsts.count("b") == 10


# ---------------------------------------------------------------- fill-in-the-middle

class CharTokenizer:
    """One id per character, plus EOD and the FIM tokens."""

    name = "chars"
    specials = ["<eod>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|file|>"]

    def __init__(self):
        self.eod = 256

    def vocabulary(self):
        return {**{i: chr(i) for i in range(256)}, **{256 + k: s for k, s in enumerate(self.specials)}}

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(self.vocabulary()[i] for i in ids)


def fim_sections(**kw):
    return DataSection(source="jsonl", files=["x.jsonl"], fim=kw).fim


class ScriptedDraws:
    """Stands in for the RandomState: hands out the given rate/spm_rate bits and cut pairs in order."""

    def __init__(self, bits, cuts=()):
        self.bits, self.cuts = list(bits), list(cuts)

    def binomial(self, n, p):
        return self.bits.pop(0)

    def randint(self, low, high, size):
        cut = self.cuts.pop(0)
        assert low == 0 and all(c < high for c in cut) and size == 2
        return np.asarray(cut)

    def used_up(self):
        return not self.bits and not self.cuts


P, M, S, PAD, FILE = "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|file|>"


def fim_tokens(tok, pieces):
    """Token ids of a list of characters and special-token names."""
    ids = {t: i for i, t in tok.vocabulary().items()}
    return [ids[p] if len(p) > 1 else ord(p) for p in pieces]


# (data.fim fields, sample, rate/spm bits in draw order, cuts, expected tokens), all as Megatron-LM writes them
FIM_LAYOUTS = {
    # PSM; the whole sample (not the suffix) is cut at its end; the empty stretch after the last EOD is drawn for
    "psm": ({}, [*"abcdef", "<eod>"], [1, 0, 0], [(2, 4)], [P, *"ab", S, *"ef", M]),
    # SPM: <prefix> <suffix> suffix <middle> prefix middle; the cut pair is sorted
    "spm": ({}, [*"abcdef"], [1, 1], [(4, 1)], [P, S, *"ef", M, *"a"]),
    # EODs closing empty stretches are dropped, the sample is padded at its end
    "eod_dropped_padded": ({}, ["<eod>", "<eod>", *"ab"], [0], [], [*"ab", PAD, PAD]),
    # the empty stretch after the last EOD is rewritten too when its draw says so
    "empty_tail": ({}, ["<eod>", "<eod>", "<eod>", *"ab", "<eod>"], [0, 1, 0], [(0, 0)],
                   [*"ab", "<eod>", P, S, M]),
    # split_sample: one rate draw for the document, then fragment_rate draws; a split token closing an empty
    # fragment is dropped
    "split": ({"split_sample": FILE}, [*"ab", FILE, FILE, *"cdef", "<eod>", *"gh", "<eod>"],
              [1, 0, 1, 0, 0, 0], [(1, 3)], [*"ab", FILE, P, *"c", S, *"f", M, *"de", "<eod>", "g"]),
    # a document not chosen by the rate draw keeps its split tokens, empty fragments and all
    "split_not_chosen": ({"split_sample": FILE}, [*"ab", FILE, FILE, *"cd"], [0], [], [*"ab", FILE, FILE, *"cd"]),
    # no_prefix: the rate draw is made, the cut and order draws are not
    "no_prefix": ({"no_prefix": "ab"}, [*"abc", "<eod>", *"xy"], [1, 1, 0], [(1, 1)], [*"abc", "<eod>", P, "x"]),
}


@pytest.mark.parametrize("case", FIM_LAYOUTS)
def test_fim_layout_as_megatron_lm_writes_it(case):
    from megacli.data.fim import fim_ids, fim_sample

    fields, sample, bits, cuts, expected = FIM_LAYOUTS[case]
    tok = CharTokenizer()
    fim = fim_sections(rate=0.5, spm_rate=0.5, fragment_rate=0.5, **fields)
    draws = ScriptedDraws(bits, cuts)
    out = fim_sample(np.asarray(fim_tokens(tok, sample)), draws, fim=fim, tokenizer=tok, ids=fim_ids(tok, fim))
    assert out.tolist() == fim_tokens(tok, expected)
    assert draws.used_up()


def test_fim_samples_decode_to_prefix_suffix_middle():
    from megacli.data.fim import fim_ids, fim_sample

    tok = CharTokenizer()
    fim = fim_sections(rate=1.0, spm_rate=0.0)
    doc = "def f(x): return x + 1"
    sample = np.asarray(tok.encode(doc) + [tok.eod] + tok.encode("pad"))
    for seed in range(20):
        out = fim_sample(sample, np.random.RandomState(seed), fim=fim, tokenizer=tok, ids=fim_ids(tok, fim))
        assert len(out) == len(sample)
        text = tok.decode(out.tolist()).split("<eod>")[0]
        prefix, rest = text[len("<fim_prefix>"):].split("<fim_suffix>")
        suffix, middle = rest.split("<fim_middle>")
        assert text.startswith("<fim_prefix>") and prefix + middle + suffix == doc


def test_fim_rate_zero_leaves_samples_and_split_sample_rewrites_fragments():
    from megacli.data.fim import fim_ids, fim_sample

    tok = CharTokenizer()
    one, two = "abcdefghijklmnopqrstuvwxyz", "0123456789ABCDEFGHIJKLMNOP"
    sample = np.asarray(tok.encode(one) + [261] + tok.encode(two) + [tok.eod])
    off = fim_sections(rate=0.0)
    assert fim_sample(sample, np.random.RandomState(0), fim=off, tokenizer=tok, ids=fim_ids(tok, off)).tolist() == sample.tolist()
    split = fim_sections(rate=1.0, spm_rate=0.0, split_sample="<|file|>", fragment_rate=1.0)
    both = 0
    for seed in range(10):
        out = fim_sample(sample, np.random.RandomState(seed), fim=split, tokenizer=tok, ids=fim_ids(tok, split))
        fragments = tok.decode(out.tolist()).split("<eod>")[0].split("<|file|>")
        assert len(fragments) == 2
        assert all(f == orig or f.startswith("<fim_prefix>") for f, orig in zip(fragments, (one, two)))
        both += all(f.startswith("<fim_prefix>") for f in fragments)
    assert both >= 3  # the seeds are fixed: 4 of 10 rewrite both fragments


def test_fim_names_missing_tokens():
    from megacli.data.fim import fim_ids
    from megacli.data.tokenizers import load_tokenizer
    from megacli.errors import UserError

    with pytest.raises(UserError, match="data.fim.prefix_token"):
        fim_ids(load_tokenizer(type="byte", path=None), fim_sections())


def first_sample_or_error(stream: RankStream, timeout: float = 30):
    """next(stream) in a thread, so that a stream that never yields fails the test instead of hanging it."""
    import threading

    got = {}

    def read():
        try:
            got["sample"] = next(stream)
        except Exception as exc:
            got["error"] = exc

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    stream.close()
    assert got, f"no sample and no error within {timeout} s"
    return got.get("sample"), got.get("error")


@pytest.mark.parametrize("world", [1, 2])
def test_documents_without_text_are_refused_not_hung(tmp_path, world):
    """Empty documents give no tokens, not even EOD: packing waited for tokens forever. With 2
    data-parallel ranks, rank 0's documents are the empty ones."""
    from megacli.errors import UserError

    texts_ = [""] * 50 if world == 1 else ["", "x"] * 25
    path = write_jsonl(tmp_path / "empty.jsonl", texts_)
    stream = RankStream([jsonl_source(path)], spec=BYTE, seq_length=SEQ, rank=0, world=world, workers=0)
    sample, error = first_sample_or_error(stream)
    assert isinstance(error, UserError), (sample, error)
    whose = "25 documents of data-parallel rank 0 of 2" if world == 2 else "50 documents"
    assert str(error) == f"on-the-fly data {[str(path)]!r}: all {whose} have an empty 'text': nothing to train on"


def test_pretrain_and_its_dry_run_refuse_a_corpus_without_text(tmp_path):
    from typer.testing import CliRunner

    from megacli.cli import _register, app
    from tests.conftest import MOCK_GPT as TINY

    path = write_jsonl(tmp_path / "empty.jsonl", [""] * 50)
    sets = [*TINY, "data.mock=false", "data.source=jsonl", f"data.files=[{path}]", f"run.dir={tmp_path / 'run'}"]
    _register()
    for dry_run in (["--dry-run"], []):
        out = CliRunner().invoke(app, ["pretrain", *dry_run, *[x for s in sets for x in ("--set", s)]],
                                 env={"COLUMNS": "400", "MEGACLI_IN_PROCESS": "1"})
        assert out.exit_code == 2, (dry_run, out.output)
        assert f"all 50 documents have an empty 'text'" in out.output and str(path) in out.output, out.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_line_that_is_not_utf8_is_named_with_file_and_line(tmp_path):
    from megacli.data.stream import texts
    from megacli.errors import UserError

    path = write_jsonl(tmp_path / "c.jsonl", ["one", "two"])
    path.write_bytes(path.read_bytes() + b'{"text": "caf\xe9"}\n')
    with pytest.raises(UserError) as err:
        list(texts(jsonl_source(path)))
    assert str(err.value) == f"{path}:3: not UTF-8 (invalid continuation byte at byte 13)"


# ---------------------------------------------------------------- recipe

@pytest.mark.parametrize("fields, message", [
    ({"source": "jsonl"}, "source jsonl needs files"),
    ({"source": "hf"}, "source hf needs name"),
    ({"source": "jsonl", "files": ["a"], "path": "p"}, "reads no data.path"),
    ({"source": "jsonl", "files": ["a"], "sources": [{"source": "jsonl", "files": ["b"]}]}, "not both"),
    ({"path": "p", "fim": {}}, "no FIM dataset for indexed data"),
    ({"path": "p", "reset_attention_mask": True}, "for on-the-fly data"),
])
def test_recipe_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        DataSection(**fields)


def test_every_new_field_is_documented():
    from megacli.recipe.stream import FIMSection, StreamFields

    for section in (DataSection, StreamFields, StreamSource, FIMSection):
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name}"


def test_validation_does_not_change_the_recipe():
    d = DataSection(source="jsonl", files=["a.jsonl"])
    assert d.sources is None and d.stream_sources()[0].files == ["a.jsonl"] and d.sources is None


# ---------------------------------------------------------------- end to end

@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 2])
def test_pretrain_resume_mid_stream_equals_uninterrupted_run(tmp_path, dp):
    from tests.conftest import MOCK_GPT, layout, losses, pretrain

    corpus = write_jsonl(tmp_path / "c.jsonl", documents(200))
    stream = ["data.mock=false", "data.source=jsonl", f"data.files=[{corpus}]", "data.reset_position_ids=true",
              "data.tokenizer_workers=1", "train.iters=6", *layout(dp=dp)]
    pretrain(tmp_path / "whole", MOCK_GPT + stream)
    ck = tmp_path / "ck"
    pretrain(tmp_path / "part", MOCK_GPT + stream + [f"checkpoint.dir={ck}", "train.exit_after_iters=3"])
    saved = json.loads((ck / "iter_0000003" / "megacli.json").read_text())["stream"]
    assert [s["samples"] for s in saved] == [24 // dp] * dp  # 3 steps of 8 samples, split over the DP ranks
    assert all(s["positions"][0]["documents"] > 0 for s in saved)
    assert len({json.dumps(s) for s in saved}) == dp  # each rank at its own place in its own documents
    pretrain(tmp_path / "part", MOCK_GPT + stream + [f"checkpoint.dir={ck}"])
    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "part")
    assert sorted(resumed) == list(range(1, 7))
    for i in range(1, 7):
        assert resumed[i] == pytest.approx(whole[i], rel=1e-6, abs=0), f"step {i}"


def test_a_sources_fingerprint_changes_with_its_documents(tmp_path):
    from megacli.data.stream import EDGE_BYTES, change, fingerprint

    big = ["x" * 1000 + f" doc{i}" for i in range(3000)]  # > 2 MiB: only the first and last MiB are hashed
    path = write_jsonl(tmp_path / "c.jsonl", big)
    source = jsonl_source(path)
    saved = json.loads(json.dumps(fingerprint(source)))  # as megacli.json keeps it
    assert change(saved, fingerprint(source)) is None
    path.touch()  # a new modification time, the same documents
    assert change(saved, fingerprint(source)) is None
    for changed in (big[:-1], big + ["one more"], [big[1], big[0], *big[2:]], [*big[:-2], big[-1], big[-2]]):
        write_jsonl(path, changed)
        assert change(saved, fingerprint(source)).startswith(f"{path} differs from the file read then"), changed[:1]
    write_jsonl(path, big)
    assert change(saved, fingerprint(source)) is None
    assert path.stat().st_size > 2 * EDGE_BYTES
    two = StreamSource(source="jsonl", files=[str(path), str(path)])
    assert change(saved, fingerprint(two)) == "it has 2 files, the checkpoint's had 1"
    for damaged in ([], {"files": 3}, {"files": [1]}):
        assert change(damaged, fingerprint(source)) == "the checkpoint's record of it is unreadable"
    assert change(saved, fingerprint(StreamSource(source="jsonl", files=[str(path)], text_field="body"))).startswith(
        "it reads {'source': 'jsonl', 'name': None, 'config': None, 'hf_split': 'train', 'text_field': 'body'}")


def test_a_resume_on_changed_sources_is_refused_naming_the_source(tmp_path, monkeypatch):
    """Training saved its position in a.jsonl and b.jsonl; the sources reordered, or a.jsonl
    replaced, would apply that position to other documents: refused, unless
    data.restart_changed_sources, which reads the changed source from its first document."""
    from typer.testing import CliRunner

    from megacli.cli import _register, app
    from tests.conftest import MOCK_GPT as TINY, layout

    a = write_jsonl(tmp_path / "a.jsonl", documents(200))
    b = write_jsonl(tmp_path / "b.jsonl", [t.upper() for t in documents(100)])
    ck = tmp_path / "ck"
    monkeypatch.setenv("MEGACLI_IN_PROCESS", "1")
    _register()

    def pretrain(first, second, *sets):
        every = [*TINY, *layout(), "data.mock=false", "data.tokenizer_workers=0", "train.iters=4", f"checkpoint.dir={ck}",
                 f"data.sources=[{{source: jsonl, files: [{first}]}}, {{source: jsonl, files: [{second}]}}]",
                 f"run.dir={tmp_path / 'run'}", *sets]
        return CliRunner().invoke(app, ["pretrain", *[x for s in every for x in ("--set", s)]], env={"COLUMNS": "400"})

    out = pretrain(a, b, "train.exit_after_iters=2")
    assert out.exit_code == 0, out.output
    saved = json.loads((ck / "iter_0000002" / "megacli.json").read_text())["stream_sources"]
    assert [s["files"][0]["path"] for s in saved] == [str(a), str(b)]
    assert saved[0]["files"][0]["size"] == a.stat().st_size and len(saved[0]["files"][0]["edges_xxh3"]) == 16

    out = pretrain(b, a)
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    said = " ".join(out.output.split())
    assert said.startswith(f"error: data.sources[0]: {b} differs from the file read then ({a}:") and \
        "data.restart_changed_sources: true" in said, said
    write_jsonl(a, ["short"] + documents(199)[1:])  # another first document
    out = pretrain(a, b, "data.restart_changed_sources=true")
    assert out.exit_code == 0, out.output
    assert f"data.sources[0]: {a} differs from the file read then" in " ".join(out.output.split())
    assert "read from its first document (data.restart_changed_sources)" in " ".join(out.output.split())
    resumed = json.loads((ck / "iter_0000004" / "megacli.json").read_text())["stream"][0]["positions"]
    assert resumed[0]["documents"] < json.loads((ck / "iter_0000002" / "megacli.json").read_text())["stream"][0][
        "positions"][0]["documents"] + 3, "data.sources[0] did not start over"


@pytest.mark.parametrize("layout", ["save_to_disk", "parquet", "jsonl", "streaming parquet"])
def test_hf_local_copies_read_like_jsonl(tmp_path, layout):
    import datasets

    from megacli.data.stream import texts

    docs = documents(12)
    ds = datasets.Dataset.from_dict({"content": docs, "id": list(range(12))})
    if layout == "save_to_disk":
        ds.save_to_disk(str(tmp_path / "ds"))
        name = str(tmp_path / "ds")
    elif layout == "jsonl":
        name = str(write_jsonl(tmp_path / "d.jsonl", docs))
        ds = None
    else:
        ds.to_parquet(str(tmp_path / "d.parquet"))
        name = str(tmp_path / "*.parquet")
    source = StreamSource(source="hf", name=name, text_field="text" if layout == "jsonl" else "content",
                          streaming=layout.startswith("streaming"))
    assert list(texts(source)) == docs


def test_hf_errors_name_the_field(tmp_path):
    from megacli.data.stream import texts
    from megacli.errors import UserError

    with pytest.raises(UserError, match="data.name"):
        list(texts(StreamSource(source="hf", name=str(tmp_path / "nothing-here"))))
    corpus = write_jsonl(tmp_path / "c.jsonl", ["x"])
    with pytest.raises(UserError, match="no text field 'body'"):
        list(texts(StreamSource(source="jsonl", files=[str(corpus)], text_field="body")))
    with pytest.raises(UserError, match="matches no file"):
        list(texts(StreamSource(source="jsonl", files=[str(tmp_path / "*.jsonl.gz")])))


def test_sample_layout_follows_megatron_flags():
    from megacli.engine.stream_data import gpt_sample

    eod = 9
    text = np.asarray([1, 2, eod, 3, 4, 5, eod, 6, 7])
    plain = gpt_sample(text, eod=eod, pad=None, data=DataSection(source="jsonl", files=["x"]))
    assert plain["tokens"].tolist() == [1, 2, eod, 3, 4, 5, eod, 6] and plain["labels"].tolist() == [2, eod, 3, 4, 5, eod, 6, 7]
    assert plain["position_ids"].tolist() == list(range(8)) and plain["loss_mask"].tolist() == [1.0] * 8
    assert "segments" not in plain
    flags = DataSection(source="jsonl", files=["x"], reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    reset = gpt_sample(text, eod=eod, pad=None, data=flags)
    assert reset["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert reset["loss_mask"].tolist() == [1, 1, 0, 1, 1, 1, 0, 1]
    assert reset["segments"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]  # an EOD belongs to the document it ends


def test_indexed_data_honours_reset_position_ids_and_eod_mask_loss(tmp_path):
    from megacli.data.preprocess import Job, run
    from megacli.data.tokenizers import load_tokenizer
    from megacli.engine.data import build_gpt_datasets

    corpus = write_jsonl(tmp_path / "c.jsonl", ["ab", "cde", "fghij"] * 10)
    run(Job(inputs=[str(corpus)], output_prefix=str(tmp_path / "c"), keys=["text"], tokenizer_type="byte",
            tokenizer_path=None, append_eod=True, workers=0, progress=False))
    tok = load_tokenizer(type="byte", path=None)
    data = DataSection(path=str(tmp_path / "c_text_document"), split="1,0,0", reset_position_ids=True, eod_mask_loss=True)
    sample = build_gpt_datasets(data=data, seq_length=SEQ, seed=1, tokenizer=tok, train_samples=4, valid_samples=0,
                                cache_dir=str(tmp_path / "cache")).train[0]
    tokens = sample["tokens"]
    assert (sample["loss_mask"][tokens == tok.eod] == 0).all()
    after = (tokens == tok.eod).nonzero().flatten() + 1
    assert (sample["position_ids"][after[after < SEQ]] == 0).all()


def test_fim_batches_are_redrawn_the_same_after_a_resume(tmp_path):
    import torch

    from megacli.data.fim import fim_ids
    from megacli.engine.stream_data import StreamData

    corpus = write_jsonl(tmp_path / "c.jsonl", [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(30)])
    data = DataSection(source="jsonl", files=[str(corpus)], fim={"rate": 1.0, "spm_rate": 0.5})
    tok = CharTokenizer()  # the byte tokenizer's ids for ASCII text and EOD, plus FIM tokens

    def opened(state=None):
        sd = StreamData(data=data, spec=BYTE, tokenizer=tok, seq_length=SEQ * 4, seed=5, fim_ids=fim_ids(tok, data.fim),
                        start_state=state)
        return sd, sd.iterators(1, micro_batch_size=2, dp_rank=0, dp_size=1, device=torch.device("cpu"))[0]

    whole, batches = opened()
    expected = [next(batches)["tokens"] for _ in range(6)]
    whole.close()
    first, batches = opened()
    head = [next(batches)["tokens"] for _ in range(2)]
    state = first.state()
    first.close()
    rest, batches = opened(state)
    tail = [next(batches)["tokens"] for _ in range(4)]
    rest.close()
    assert all(torch.equal(a, b) for a, b in zip(head + tail, expected))
    decoded = [tok.decode(row.tolist()) for b in expected for row in b]
    assert sum("<fim_prefix>" in d for d in decoded) >= len(decoded) - 1


def test_a_samples_loss_mask_does_not_depend_on_what_was_read_before(tmp_path):
    """Megatron-Core 0.16.1's GPTDataset would mask every sample where the first one read had pad
    labels (its mask cache is that sample's mask, zeroed in place), so a resumed run, which reads
    another sample first, trained on other masks (found by the GPU resume test: step 11 of a run
    resumed at step 10 differed by 2e-3)."""
    from megacli.data.tokenizers import load_tokenizer
    from megacli.engine.data import build_gpt_datasets

    tok = load_tokenizer(type="byte", path=None)

    def fresh():
        return build_gpt_datasets(data=DataSection(mock=True, path=None), seq_length=SEQ, seed=1, tokenizer=tok,
                                  train_samples=40, valid_samples=0, cache_dir=str(tmp_path / "cache")).train

    with_pads = [k for k in range(40) if (fresh()._query_document_sample_shuffle_indices(k)[0][1:] == tok.pad).any()]
    assert with_pads, "mock data with pad labels (the case the mask cache got wrong)"
    after_a_padded_one, alone = fresh(), fresh()
    after_a_padded_one[with_pads[0]]
    for k in range(40):
        labels = torch.from_numpy(alone._query_document_sample_shuffle_indices(k)[0][1:])
        want = (labels != tok.pad).float()
        assert torch.equal(alone[k]["loss_mask"], want), k
        assert torch.equal(after_a_padded_one[k]["loss_mask"], want), k


def test_every_rank_checks_the_index_cache_before_rank_0_writes_to_it(tmp_path, monkeypatch):
    """Megatron-Core builds the index on rank 0 while the other ranks wait: a rank still checking
    the cache then would read a half-written file and refuse it."""
    import torch
    from megatron.core.datasets import blended_megatron_dataset_builder as builder

    from megacli.engine import data

    events = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: events.append("barrier"))
    monkeypatch.setattr(data, "check_index_cache", lambda path: events.append(f"check {path.name}"))
    monkeypatch.setattr(builder.BlendedMegatronDatasetBuilder, "__init__", lambda self, *a: None)
    monkeypatch.setattr(builder.BlendedMegatronDatasetBuilder, "build", lambda self: events.append("build"))
    data.build_megatron_splits(object, [1, 0, 0], type("Config", (), {"path_to_cache": str(tmp_path / "cache")}))
    assert events == ["check cache", "barrier", "build"]


def test_a_pickle_in_the_index_cache_is_refused(tmp_path):
    """Megatron-Core loads its cached index files with numpy.load(allow_pickle=True): a pickle saved
    under such a name is refused, naming it, and never unpickled."""
    import pickle

    from megacli.data.preprocess import Job, run
    from megacli.data.tokenizers import load_tokenizer
    from megacli.engine.data import build_gpt_datasets
    from megacli.errors import UserError

    corpus = write_jsonl(tmp_path / "c.jsonl", ["ab", "cde", "fghij"] * 10)
    run(Job(inputs=[str(corpus)], output_prefix=str(tmp_path / "c"), keys=["text"], tokenizer_type="byte",
            tokenizer_path=None, append_eod=True, workers=0, progress=False))
    tok, cache, marker = load_tokenizer(type="byte", path=None), tmp_path / "cache", tmp_path / "code-ran"

    def build():
        return build_gpt_datasets(data=DataSection(path=str(tmp_path / "c_text_document"), split="1,0,0"), seq_length=SEQ,
                                  seed=1, tokenizer=tok, train_samples=4, valid_samples=0, cache_dir=str(cache)).train

    built = len(build())
    index = sorted(cache.glob("*document_index.npy"))[0]

    class Payload:
        def __reduce__(self):
            return eval, (f"open({str(marker)!r}, 'w').close() or __import__('numpy').arange(3)",)

    index.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UserError, match=rf"{index.name}: not a \.npy array file .*loading it could run code"):
        build()
    np.save(index, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UserError, match=rf"{index.name}: an array of Python objects"):
        build()
    assert not marker.exists()
    index.unlink()
    assert len(build()) == built  # a deleted index is rebuilt


def _pretrain_dry_run(sets: list[str]):
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    return CliRunner().invoke(app, ["pretrain", *[x for s in sets for x in ("--set", s)], "--dry-run"],
                              env={"COLUMNS": "300"})


@pytest.mark.parametrize("case", ["fim_tokens", "hf_glob", "hf_file_type"])
def test_on_the_fly_sources_are_checked_by_the_dry_run_and_before_workers_start(tmp_path, case):
    from megacli.cli.training import check_inputs
    from megacli.errors import UserError
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe
    from tests.conftest import MOCK_GPT as TINY

    corpus = write_jsonl(tmp_path / "c.jsonl", documents(4))
    (tmp_path / "c.csv").write_text("text\nx\n")
    source = {"fim_tokens": ["data.source=jsonl", f"data.files=[{corpus}]", "data.fim={}"],
              "hf_glob": ["data.source=hf", f"data.name={tmp_path / 'shards' / '*.parquet'}"],
              "hf_file_type": ["data.source=hf", f"data.name={tmp_path / '*.csv'}"]}[case]
    sets = [*TINY, "data.mock=false", *source, f"run.dir={tmp_path / 'run'}"]
    expected = {"fim_tokens": "data.fim.prefix_token", "hf_glob": "matches no file",
                "hf_file_type": "c.csv: unknown file type"}[case]
    out = _pretrain_dry_run(sets)
    assert out.exit_code == 2 and expected in out.output, out.output
    with pytest.raises(UserError, match=expected):
        check_inputs(base.load(TrainingRecipe, None, sets))
    assert not (tmp_path / "run").exists()


def test_a_text_field_that_is_not_a_string_is_named_with_its_type(tmp_path):
    from megacli.data.stream import texts
    from megacli.errors import UserError

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": 12345}\n')
    with pytest.raises(UserError, match=rf"{corpus}:2: field 'text' is int 12345, not a string"):
        list(texts(StreamSource(source="jsonl", files=[str(corpus)])))
    corpus.write_text('["text"]\n')
    with pytest.raises(UserError, match=rf"{corpus}:1: not a JSON object"):
        list(texts(StreamSource(source="jsonl", files=[str(corpus)])))


def test_every_line_reader_names_a_line_that_is_not_utf8_alike(tmp_path):
    """Preference pairs, instruction data, generate's --prompts/--score/--cloze files and on-the-fly
    JSONL all read through data/jsonl.py: preprocess's `file:line: not UTF-8 (...)`, no traceback."""
    from megacli.data.preference import read_pairs
    from megacli.data.sft import read_records
    from megacli.data.stream import texts
    from megacli.errors import UserError
    from megacli.inference.job import read_texts

    pair = json.dumps({"prompt": "a", "chosen": "b", "rejected": "c", "response": "d", "text": "e"}).encode()
    path = tmp_path / "d.jsonl"
    path.write_bytes(pair + b"\n\n" + pair[:-2] + b'\xff"}\n')
    readers = [read_pairs, read_records, lambda p: read_texts(p, "prompt"), lambda p: list(texts(jsonl_source(Path(p))))]
    for read in readers:
        with pytest.raises(UserError) as err:
            read(str(path))
        assert str(err.value) == f"{path}:3: not UTF-8 (invalid start byte at byte {len(pair) - 2})", err.value
    path.write_bytes(b"\xef\xbb\xbf" + pair + b"\r\n" + b"plain \xe2\x80\xa8 text\n")  # a BOM, CRLF, U+2028 inside a line
    assert read_texts(str(path), "prompt") == ["a", "plain \u2028 text"]
