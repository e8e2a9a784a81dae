"""`megacli preprocess` on gigatoken: the same bytes as the tokenizer's own library (byte-level BPE
and SentencePiece BPE), the fallback with a note where gigatoken differs or is missing, chunked
streaming, the numpy document layout and the quick JSON parse."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megacli.data import readers
from megacli.data.fast_tokenize import GigatokenTokenizer, accelerate
from megacli.data.preprocess import run
from megacli.data.preprocess_workers import megatron_layout
from megacli.data.tokenizers import load_tokenizer
from tests.test_preprocess import REPO, SENTENCES, expected_dataset, job, read_pair, write_jsonl

pytest.importorskip("gigatoken")

HARD = [
    "A literal </s> and <s> written in the text, and <unk> too.",
    "  leading spaces, trailing spaces  ",
    "multiple   spaces\tand\ttabs\r\nand CRLF",
    "🚀 emoji, ﬁ ligature, nai\u0308ve combining, 日本語",
]


def rich_corpus(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    pool = SENTENCES + HARD
    docs = [{"text": " ".join(rng.choice(pool) for _ in range(rng.randint(1, 6))),
             "title": rng.choice(pool)[:25]} for _ in range(n)]
    docs[2]["text"] = ""
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", rich_corpus(300))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, corpus) -> Path:
    """A byte-level BPE trained by data_tools/train_tokenizer.py on the corpus."""
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    subprocess.run([sys.executable, str(REPO / "data_tools/train_tokenizer.py"), "--input", str(corpus),
                    "--output", str(out), "--vocab-size", "400"], check=True, capture_output=True)
    return out


def train_sentencepiece(tmp_path: Path, model_type: str = "bpe") -> Path:
    import sentencepiece as spm

    text_file = tmp_path / "train.txt"
    text_file.write_text("\n".join((SENTENCES + HARD) * 20), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text_file), model_prefix=str(tmp_path / model_type), vocab_size=400,
                                   model_type=model_type, byte_fallback=True, character_coverage=0.98, minloglevel=2)
    return tmp_path / f"{model_type}.model"


def both_paths(tmp_path, corpus, tokenizer, monkeypatch, **kw):
    """(gigatoken run, plain run) of the same job."""
    fast = run(job([corpus], tmp_path / "fast", tokenizer, **kw))
    with monkeypatch.context() as m:
        m.setenv("MEGACLI_NO_GIGATOKEN", "1")
        plain = run(job([corpus], tmp_path / "plain", tokenizer, **kw))
    return fast, plain


def test_byte_level_bpe_gives_the_plain_path_bytes(tmp_path, corpus, hf_dir, monkeypatch):
    fast, plain = both_paths(tmp_path, corpus, ("huggingface", hf_dir), monkeypatch,
                             keys=["text", "title"], append_eod=True, add_bos=True, workers=2)
    assert fast.encoder.startswith("gigatoken") and not fast.notes
    assert "gigatoken" not in plain.encoder and "MEGACLI_NO_GIGATOKEN" in plain.notes[0]
    for key in ("text", "title"):
        assert read_pair(fast.outputs[key]) == read_pair(plain.outputs[key])


def test_sentencepiece_bpe_gives_the_plain_path_bytes(tmp_path, corpus, monkeypatch):
    import sentencepiece as spm

    model = train_sentencepiece(tmp_path)
    fast, plain = both_paths(tmp_path, corpus, ("sentencepiece", model), monkeypatch, append_eod=True)
    assert fast.encoder.startswith("gigatoken") and not fast.notes
    assert read_pair(fast.outputs["text"]) == read_pair(plain.outputs["text"])
    # and both are what sentencepiece itself gives; "</s>" in the text is characters, not the token
    sp = spm.SentencePieceProcessor(model_file=str(model))
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    docs = [[sp.encode_as_ids(t) + [sp.eos_id()]] if t else [] for t in texts]
    assert read_pair(fast.outputs["text"]) == expected_dataset(docs, np.uint16)
    tok, _ = accelerate(load_tokenizer(type="sentencepiece", path=str(model)), list)
    assert isinstance(tok, GigatokenTokenizer) and "</s>" in tok.defer and "<s>" in tok.defer


def test_chunked_streaming_gives_the_bytes_of_one_chunk(tmp_path, corpus, hf_dir, monkeypatch):
    calls = []
    encode_flat = GigatokenTokenizer.encode_flat
    monkeypatch.setattr(GigatokenTokenizer, "encode_flat", lambda self, texts: calls.append(len(texts)) or encode_flat(self, texts))
    tok = ("huggingface", hf_dir)
    whole = run(job([corpus], tmp_path / "whole", tok, append_eod=True, chunk_mb=64))
    assert len(calls) == 1
    chunked = run(job([corpus], tmp_path / "chunked", tok, append_eod=True, chunk_mb=0.001))
    assert len(calls) > 10 and whole.encoder.startswith("gigatoken")
    assert read_pair(chunked.outputs["text"]) == read_pair(whole.outputs["text"])


def test_a_tokenizer_gigatoken_misreads_falls_back_with_a_note(tmp_path, corpus, hf_dir, monkeypatch):
    # gigatoken reads this tokenizer.json but ignores use_regex: false (no word splitting)
    config = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    config["pre_tokenizer"]["use_regex"] = False
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "tokenizer.json").write_text(json.dumps(config), encoding="utf-8")
    (odd / "tokenizer_config.json").write_text((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    fast, plain = both_paths(tmp_path, corpus, ("huggingface", odd), monkeypatch, append_eod=True)
    assert fast.encoder.startswith("the tokenizers library")
    assert len(fast.notes) == 1 and fast.notes[0].startswith("gigatoken gives other ids than the tokenizers library")
    assert read_pair(fast.outputs["text"]) == read_pair(plain.outputs["text"])


def test_a_disagreement_in_the_corpus_sample_alone_falls_back(hf_dir, monkeypatch):
    tokenizer = load_tokenizer(type="huggingface", path=str(hf_dir))
    assert isinstance(accelerate(tokenizer, lambda: ["a document"])[0], GigatokenTokenizer)
    real = GigatokenTokenizer.encode_batch
    monkeypatch.setattr(GigatokenTokenizer, "encode_batch",
                        lambda self, texts: [ids[:-1] if t == "a document" else ids for t, ids in zip(texts, real(self, texts))])
    used, note = accelerate(tokenizer, lambda: ["a document"])
    assert used is tokenizer and "on 1 of" in note and "'a document'" in note


def test_unsupported_or_missing_gigatoken_keeps_the_plain_path(tmp_path, hf_dir, monkeypatch):
    unigram = load_tokenizer(type="sentencepiece", path=str(train_sentencepiece(tmp_path, "unigram")))
    used, note = accelerate(unigram, list)
    assert used is unigram and "only BPE sentencepiece models" in note and "\n" not in note
    byte = load_tokenizer(type="byte", path=None)
    assert accelerate(byte, lambda: pytest.fail("the corpus is sampled for a tokenizer gigatoken cannot serve")) == (byte, None)
    monkeypatch.setitem(sys.modules, "gigatoken", None)
    hf = load_tokenizer(type="huggingface", path=str(hf_dir))
    used, note = accelerate(hf, list)
    assert used is hf and "gigatoken is not installed" in note


def test_the_command_says_which_encoder_it_used(tmp_path, corpus, hf_dir):
    def preprocess(prefix, **env):
        import os

        return subprocess.run([sys.executable, "-m", "megacli", "preprocess", "--input", str(corpus), "--output-prefix",
                               str(tmp_path / prefix), "--tokenizer", str(hf_dir), "--workers", "0", "--no-progress"],
                              capture_output=True, text=True, env={**os.environ, **env})

    out = preprocess("a")
    assert out.returncode == 0, out.stderr
    assert "gigatoken" in " ".join(out.stdout.split()) and "note" not in out.stderr
    out = preprocess("b", MEGACLI_NO_GIGATOKEN="1")
    assert out.returncode == 0, out.stderr
    assert "note: MEGACLI_NO_GIGATOKEN is set" in " ".join(out.stderr.split())


def test_megatron_layout_matches_a_sequence_by_sequence_reference():
    def reference(docs, bos, eod):
        tokens, lengths, per_doc = [], [], []
        for doc in docs:
            kept = [list(s) for s in doc if s]
            if kept and bos is not None:
                kept[0] = [bos] + kept[0]
            if kept and eod is not None:
                kept[-1] = kept[-1] + [eod]
            per_doc.append(len(kept))
            lengths += [len(s) for s in kept]
            tokens += [t for s in kept for t in s]
        return tokens, lengths, per_doc

    rng = random.Random(0)
    for _ in range(300):
        docs = [[[rng.randint(0, 99) for _ in range(rng.choice([0, 0, 1, 2, 5]))] for _ in range(rng.randint(0, 4))]
                for _ in range(rng.randint(0, 6))]
        bos, eod = rng.choice([None, 100]), rng.choice([None, 101])
        pieces = [s for d in docs for s in d]
        got = megatron_layout(np.array([t for s in pieces for t in s], np.int64), np.array([len(s) for s in pieces], np.int64),
                              np.array([len(d) for d in docs], np.int64), np.dtype(np.uint16), bos, eod)
        assert got[0].dtype == np.uint16 and got[1].dtype == np.int32 and got[2].dtype == np.int64
        assert tuple(a.tolist() for a in got) == reference(docs, bos, eod), (docs, bos, eod)


@pytest.mark.parametrize("keys, records", [(["text"], 9), (["text", "title"], 7)])
def test_quick_json_parse_agrees_with_the_json_module(keys, records):
    lines = [
        '{"text": "plain", "title": "t"}',
        '{"text": "dup", "text": "last wins", "title": "t"}',
        '{"text": "escapes \\u00e9 \\n \\"q\\"", "title": "t"}',
        '{"text": "lone \\ud800 surrogate", "title": "t"}',  # json accepts, orjson refuses
        '{"text": "x", "title": "t", "n": NaN}',  # json accepts NaN
        '{"text": 123456789012345678901234567890, "title": "t"}',  # orjson would read a float
        '{"text": ["sentence one", "two"], "title": "t"}',
        '{"text": "x"}',
        '{"text": "x", "title": null}',
        '[1, 2]',
        '"text"',
        '{"text": "unterminated}',
        '\ufeff{"text": "bom", "title": "t"}',
        '   ',
        '',
        '{"text": "crlf", "title": "t"}\r',
    ]
    payload = "\n".join(lines).encode() + b"\n" + b'{"text": "bad \xff utf8", "title": "t"}\n'
    source = readers.Source("c.jsonl", "jsonl", len(payload))
    parsed = readers.parse_chunk(readers.Chunk(source, 1, "lines", payload, len(payload)), keys)

    expected = readers.Parsed(values={k: [] for k in keys})
    for number, raw in enumerate(payload.split(b"\n")[:-1], 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError:
            expected.errors.append(number)
            continue
        values = [record.get(k) for k in keys] if isinstance(record, dict) else [None]
        if not all(isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)) for v in values):
            expected.errors.append(number)
            continue
        for k, v in zip(keys, values):
            expected.values[k].append(v)
        expected.records += 1
    assert parsed.values == expected.values and parsed.records == expected.records == records
    assert [line for line, _ in parsed.errors] == expected.errors
    assert "is int" in dict(parsed.errors)[6]  # the json module's reading, not orjson's float
