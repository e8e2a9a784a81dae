"""`megacli preprocess`: the bytes Megatron expects, read back by Megatron-Core, every input
format and tokenizer, bad records, interruption, partitions, merge and inspect."""

from __future__ import annotations

import gzip
import json
import random
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megacli.data import indexed
from megacli.data.preprocess import Job, run
from megacli.data.tokenizers import ByteTokenizer, load_tokenizer
from megacli.errors import UserError

REPO = Path(__file__).resolve().parent.parent

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "It's 2024, and we've got 3.5 million reasons to test tokenizers!",
    "Dr. Smith went to Washington. He arrived at 10 a.m. on Monday.",
    "Naïve café owners said: \"Crème brûlée costs €5.\"",
    "Tabs\tand  double  spaces,\nnewlines\n\nand paragraphs.",
    "Mixed CASE words, don't WON'T they'll I'm you're.",
    "Numbers like 1234567890 and 3.14159 appear here.",
    "A literal <|endoftext|> inside the text must stay a special token.",
    "日本語のテキストも少し含まれています。",
    "Short.",
]


def make_corpus(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        k = rng.randint(1, 6)
        text = " ".join(rng.choice(SENTENCES) for _ in range(k))
        docs.append({"text": text, "title": f"Document {i}: {SENTENCES[i % len(SENTENCES)][:20]}", "id": i})
    docs[3]["text"] = ""  # an empty document is kept (as Megatron keeps it)
    return docs


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", make_corpus(120))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, corpus) -> Path:
    """A byte-level BPE trained by data_tools/train_tokenizer.py (the demo's tool)."""
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    subprocess.run([sys.executable, str(REPO / "data_tools/train_tokenizer.py"), "--input", str(corpus),
                    "--output", str(out), "--vocab-size", "400"], check=True, capture_output=True)
    return out


def job(inputs, prefix, tokenizer=("byte", None), **kw) -> Job:
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    return Job(inputs=[str(i) for i in inputs], output_prefix=str(prefix), keys=kw.pop("keys", ["text"]),
               tokenizer_type=tokenizer[0], tokenizer_path=tokenizer[1] and str(tokenizer[1]), **kw)


def expected_dataset(docs: list[list[list[int]]], dtype) -> tuple[bytes, bytes]:
    """.bin and .idx bytes written from the format spec: docs -> sequences -> token ids."""
    dtype = np.dtype(dtype)
    code = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}[dtype]
    seqs = [s for d in docs for s in d]
    lengths = [len(s) for s in seqs]
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * dtype.itemsize
    doc_index = [0]
    for d in docs:
        doc_index.append(doc_index[-1] + len(d))
    bin_bytes = b"".join(np.asarray(s, dtype).tobytes() for s in seqs)
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
           + struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_index))
           + np.asarray(lengths, np.int32).tobytes() + np.asarray(pointers, np.int64).tobytes()
           + np.asarray(doc_index, np.int64).tobytes())
    return bin_bytes, idx


def read_pair(prefix) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def megatron_reference(hf_dir: Path, texts: list[str], append_eod: bool) -> list[list[list[int]]]:
    """What Megatron-LM's HuggingFaceTokenizer does per document: AutoTokenizer.tokenize, then
    convert_tokens_to_ids; eod (eos_token) appended to non-empty documents."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    docs = []
    for text in texts:
        ids = tok.convert_tokens_to_ids(tok.tokenize(text))
        if ids and append_eod:
            ids.append(tok.eos_token_id)
        docs.append([ids] if ids else [])
    return docs


# ---- format and parity ----
def test_header_and_bytes_follow_the_format(tmp_path, corpus):
    res = run(job([corpus], tmp_path / "out", append_eod=True))
    prefix = res.outputs["text"]
    assert prefix == f"{tmp_path}/out_text_document"
    bin_bytes, idx = read_pair(prefix)
    magic, version, code, seqs, docs = struct.unpack("<9sQBQQ", idx[:34])
    assert (magic, version, code) == (b"MMIDIDX\x00\x00", 1, 8)  # byte vocab (262) -> uint16
    records = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    assert docs == len(records) + 1 and seqs == len(records) - 1  # the empty document has no sequence
    lengths = np.frombuffer(idx, np.int32, seqs, 34)
    pointers = np.frombuffer(idx, np.int64, seqs, 34 + 4 * seqs)
    doc_index = np.frombuffer(idx, np.int64, docs, 34 + 12 * seqs)
    assert len(idx) == 34 + 12 * seqs + 8 * docs
    assert doc_index[0] == 0 and pointers[0] == 0 and np.all(np.diff(pointers) == 2 * lengths[:-1])
    assert len(bin_bytes) == 2 * int(lengths.sum())
    first = np.frombuffer(bin_bytes, np.uint16, lengths[0])
    assert bytes(first[:-1].tolist()) == records[0]["text"].encode() and first[-1] == 256  # eod


def test_bytes_match_an_independent_megatron_style_computation(tmp_path, corpus, hf_dir):
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    res = run(job([corpus], tmp_path / "out", ("huggingface", hf_dir), append_eod=True, workers=2))
    assert read_pair(res.outputs["text"]) == expected_dataset(megatron_reference(hf_dir, texts, True), np.uint16)
    # without eod too, and the byte tokenizer computed by hand
    res = run(job([corpus], tmp_path / "noeod", ("huggingface", hf_dir)))
    assert read_pair(res.outputs["text"]) == expected_dataset(megatron_reference(hf_dir, texts, False), np.uint16)
    res = run(job([corpus], tmp_path / "byte", append_eod=True))
    docs = [[list(t.encode()) + [256]] if t else [] for t in texts]
    assert read_pair(res.outputs["text"]) == expected_dataset(docs, np.uint16)


def test_megatron_core_reads_it_back(tmp_path, corpus, hf_dir):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    res = run(job([corpus], tmp_path / "out", ("huggingface", hf_dir), append_eod=True, keys=["text", "title"]))
    tok = load_tokenizer(type="huggingface", path=str(hf_dir))
    records = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    for key in ("text", "title"):
        ds = IndexedDataset(res.outputs[key])
        assert len(ds.document_indices) == len(records) + 1
        nonempty = [r[key] for r in records if r[key]]
        assert len(ds) == len(nonempty)
        for i in (0, 5, len(ds) - 1):
            assert ds[i].tolist() == tok.encode(nonempty[i]) + [tok.eod]
        assert ds.index.dtype == np.uint16


def test_add_bos_and_eod_wrap_each_non_empty_document(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "Ab. Cd."}, {"text": ""}, {"text": ["x", "", "yz"]}])
    res = run(job([path], tmp_path / "o", add_bos=True, append_eod=True))
    bos, eod = 257, 256
    docs = [[[bos, *b"Ab. Cd.", eod]], [], [[bos, *b"x"], [*b"yz", eod]]]  # a list value is sentences
    assert read_pair(res.outputs["text"]) == expected_dataset(docs, np.uint16)


def test_multi_key_writes_every_key(tmp_path, corpus):
    res = run(job([corpus], tmp_path / "mk", keys=["text", "title"], append_eod=True))
    assert set(res.outputs) == {"text", "title"}
    for key in ("text", "title"):
        single = run(job([corpus], tmp_path / f"single_{key}", keys=[key], append_eod=True))
        assert read_pair(res.outputs[key]) == read_pair(single.outputs[key])
        assert Path(res.outputs[key] + ".idx").name == f"mk_{key}_document.idx"


def test_workers_and_partitions_do_not_change_the_bytes(tmp_path, corpus, hf_dir):
    tok = ("huggingface", hf_dir)
    ref = read_pair(run(job([corpus], tmp_path / "a", tok, append_eod=True)).outputs["text"])
    got = run(job([corpus], tmp_path / "b", tok, append_eod=True, workers=2, chunk_mb=0.001, partitions=3))
    assert read_pair(got.outputs["text"]) == ref
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("b_")) == ["b_text_document.bin", "b_text_document.idx"]


def test_every_recipe_field_is_documented():
    from megacli.recipe.preprocess import PreprocessRecipe, PreprocessSection
    from megacli.recipe.data_sections import TokenizerSection

    for section in (PreprocessRecipe, PreprocessSection, TokenizerSection):
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no description"


# ---- tokenizers ----
def test_byte_tokenizer_round_trip():
    tok = load_tokenizer(type="byte", path=None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 262
    assert (tok.eod, tok.bos, tok.pad, tok.cls, tok.sep, tok.mask) == (256, 257, 258, 259, 260, 261)
    text = "héllo, wörld — 日本 🚀\n"
    ids = tok.encode(text)
    assert ids == list(text.encode()) and tok.decode(ids) == text
    assert tok.decode(ids + [tok.eod]) == text + "<eod>"
    assert tok.encode_batch(["a", ""]) == [[97], []]


def test_hf_fast_path_matches_the_rust_pipeline(hf_dir):
    """The ASCII fast path must give exactly the ids of the full Rust tokenizer."""
    from tokenizers import Tokenizer as Rust

    tok = load_tokenizer(type="huggingface", path=str(hf_dir))
    assert tok._fast is not None
    rust = Rust.from_file(str(hf_dir / "tokenizer.json"))
    rng = random.Random(1)
    alphabet = [chr(i) for i in range(128)]
    weights = [3 if c.isalnum() else 2 if c in " '\n" else 1 for c in alphabet]
    texts = ["".join(rng.choices(alphabet, weights, k=rng.randint(0, 80))) for _ in range(3000)]
    texts += ["".join(rng.choice(["'s", "'S", "'ll", " '", "  ", "\t\n", "x", "7", "don't", "\x0b", "\x1c", "<|endoftext|>", "é"])
                      for _ in range(rng.randint(1, 12))) for _ in range(3000)]
    texts += SENTENCES
    assert tok.encode_batch(texts) == [e.ids for e in rust.encode_batch(texts, add_special_tokens=False)]


def test_sentencepiece_tokenizer(tmp_path, corpus):
    import sentencepiece as spm

    text_file = tmp_path / "train.txt"
    text_file.write_text("\n".join(SENTENCES * 20), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text_file), model_prefix=str(tmp_path / "sp"), vocab_size=120,
                                   model_type="bpe", minloglevel=2)
    model = tmp_path / "sp.model"
    tok = load_tokenizer(type="sentencepiece", path=str(model))
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert tok.eod == sp.eos_id() and tok.vocab_size == sp.get_piece_size()
    res = run(job([corpus], tmp_path / "sp", ("sentencepiece", model), append_eod=True))
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    docs = [[sp.encode_as_ids(t) + [sp.eos_id()]] if sp.encode_as_ids(t) else [] for t in texts]
    assert read_pair(res.outputs["text"]) == expected_dataset(docs, np.uint16)


def test_wordpiece_tokenizer(tmp_path):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "quick", "brown", "fox", "##es", ".", ",", "a", "##b"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tok = load_tokenizer(type="wordpiece", path=str(tmp_path / "vocab.txt"))
    assert tok.lower_case and tok.vocab_size == len(vocab) + 2  # [BOS] and [EOS] appended, as Megatron does
    assert (tok.bos, tok.eod, tok.cls, tok.sep, tok.mask, tok.pad) == (14, 15, 2, 3, 4, 0)
    assert tok.encode("The QUICK foxes, Ab.") == [5, 6, 8, 9, 11, 12, 13, 10]
    assert tok.encode("zebra") == [1]


# ---- inputs ----
def test_every_input_format_gives_the_same_dataset(tmp_path, corpus):
    records = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    nonempty = [r for r in records if r["text"]]  # a blank text line is no document
    ref = read_pair(run(job([write_jsonl(tmp_path / "ref.jsonl", nonempty)], tmp_path / "ref", append_eod=True)).outputs["text"])

    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in nonempty)
    half = len(nonempty) // 2
    write_jsonl(tmp_path / "part-0.jsonl", nonempty[:half])
    write_jsonl(tmp_path / "part-1.jsonl", nonempty[half:])
    txt = tmp_path / "c.txt"
    txt.write_text("".join(r["text"].replace("\n", " ") + "\n" for r in nonempty), encoding="utf-8")

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": [r["text"] for r in nonempty], "id": [r["id"] for r in nonempty]})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=7)
    import datasets

    datasets.Dataset.from_dict({"text": [r["text"] for r in nonempty]}).save_to_disk(str(tmp_path / "hfds"))

    arrow_files = sorted((tmp_path / "hfds").glob("*.arrow"))  # datasets' own data files
    for name, inputs in {"gz": [gz], "glob": [tmp_path / "part-*.jsonl"], "parquet": [tmp_path / "c.parquet"],
                         "hf": [tmp_path / "hfds"], "arrow": arrow_files}.items():
        got = run(job(inputs, tmp_path / name, append_eod=True, chunk_mb=0.002))
        assert read_pair(got.outputs["text"]) == ref, name
        assert got.stats.documents == len(nonempty)
    # text: newlines inside documents were flattened, so compare with the flattened corpus
    flat = [{"text": r["text"].replace("\n", " ")} for r in nonempty]
    flat_ref = read_pair(run(job([write_jsonl(tmp_path / "flat.jsonl", flat)], tmp_path / "flat", append_eod=True)).outputs["text"])
    assert read_pair(run(job([txt], tmp_path / "txt", append_eod=True)).outputs["text"]) == flat_ref
    # a document per file
    (tmp_path / "files").mkdir()
    for i in range(3):
        (tmp_path / "files" / f"{i}.txt").write_text(f"line one of {i}\nline two\n", encoding="utf-8")
    got = run(job([tmp_path / "files" / "*.txt"], tmp_path / "perfile", document_per_line=False))
    assert indexed.read_index(got.outputs["text"]).document_count == 3


# ---- sentences ----
def test_split_sentences_writes_sentence_datasets(tmp_path, corpus, hf_dir):
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    from megacli.data.sentences import SentenceSplitter, pretrained_parameters

    res = run(job([corpus], tmp_path / "ss", ("huggingface", hf_dir), split_sentences=True, append_eod=True))
    prefix = res.outputs["text"]
    assert prefix.endswith("ss_text_sentence")
    tok = load_tokenizer(type="huggingface", path=str(hf_dir))
    punkt = PunktSentenceTokenizer(pretrained_parameters("english")) if pretrained_parameters("english") else PunktSentenceTokenizer()
    docs = []
    for line in corpus.read_text(encoding="utf-8").splitlines():
        seqs = [ids for ids in (tok.encode(s) for s in punkt.tokenize(json.loads(line)["text"])) if ids]
        if seqs:
            seqs[-1] = seqs[-1] + [tok.eod]
        docs.append(seqs)
    assert read_pair(prefix) == expected_dataset(docs, np.uint16)
    index = indexed.read_index(prefix)
    assert index.sequence_count > index.document_count  # several sentences per document

    splitter = SentenceSplitter(keep_newlines=True)
    text = "First sentence here.\nSecond one follows.\n\nThird after a blank line."
    assert "".join(splitter(text)) == text  # newlines kept between sentences
    assert len(splitter(text)) == 3
    res = run(job([corpus], tmp_path / "nl", split_sentences=True, keep_newlines=True))
    assert indexed.exists(res.outputs["text"])


# ---- bad input ----
def test_bad_records_stop_with_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "good one"}\n{"text": "broken\n{"title": "no text"}\n{"text": "fine"}\n', encoding="utf-8")
    with pytest.raises(UserError) as err:
        run(job([path], tmp_path / "out"))
    assert f"{path}:2: malformed JSON" in str(err.value)
    assert not list(tmp_path.glob("out*"))  # nothing written, not even partial files

    res = run(job([path], tmp_path / "skip", skip_bad_records=True))
    assert res.stats.skipped == 2 and res.stats.documents == 2
    assert res.stats.skipped_examples[1].startswith(f"{path}:3: no key 'text'")
    assert indexed.read_index(res.outputs["text"]).document_count == 2


def test_bad_record_line_numbers_hold_across_chunks_and_partitions(tmp_path):
    lines = [json.dumps({"text": f"record {i}"}) for i in range(500)]
    lines[377] = '{"txt": "wrong key"}'
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for parts in (1, 4):
        with pytest.raises(UserError, match=rf"many\.jsonl:378: no key 'text'"):
            run(job([path], tmp_path / "out", chunk_mb=0.001, partitions=parts, workers=2))
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out"))
    # nothing under the final name and no partial file; finished partitions stay for a rerun
    assert left and all(".part" in name and ".partial" not in name for name in left)


def test_interrupted_run_leaves_the_old_dataset_and_no_partial_files(tmp_path, corpus, monkeypatch):
    prefix = run(job([corpus], tmp_path / "out")).outputs["text"]
    before = read_pair(prefix)
    calls = {"n": 0}
    real = indexed.IndexedDatasetWriter.add_documents

    def interrupt_second_batch(self, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(indexed.IndexedDatasetWriter, "add_documents", interrupt_second_batch)
    with pytest.raises(KeyboardInterrupt):
        run(job([corpus], tmp_path / "out", append_eod=True, chunk_mb=0.001))
    assert read_pair(prefix) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out_text_document.bin", "out_text_document.idx"]


# ---- merge and inspect ----
def test_merge_equals_preprocessing_the_concatenation(tmp_path, corpus):
    records = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    a = run(job([write_jsonl(tmp_path / "a.jsonl", records[:50])], tmp_path / "a", append_eod=True)).outputs["text"]
    b = run(job([write_jsonl(tmp_path / "b.jsonl", records[50:])], tmp_path / "b", append_eod=True)).outputs["text"]
    whole = run(job([corpus], tmp_path / "whole", append_eod=True)).outputs["text"]
    indexed.merge([a, b], str(tmp_path / "merged"))
    assert read_pair(tmp_path / "merged") == read_pair(whole)


# ---- the command line ----
def megacli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "megacli", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def test_cli_one_off_recipe_merge_and_inspect(tmp_path, corpus, hf_dir):
    out = megacli("preprocess", "--input", corpus, "--output-prefix", tmp_path / "cli", "--tokenizer", hf_dir,
                  "--append-eod", "--workers", "2")
    assert out.returncode == 0, out.stderr
    assert "documents" in out.stdout and "120" in out.stdout and "throughput" in out.stdout
    one_off = read_pair(tmp_path / "cli_text_document")

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"preprocess:\n  input: {corpus}\n  output_prefix: {tmp_path / 'rec'}\n  append_eod: false\n"
                      f"tokenizer:\n  type: huggingface\n  path: {hf_dir}\n")
    out = megacli("preprocess", recipe, "--set", "preprocess.append_eod=true", "--set", "preprocess.workers=0")
    assert out.returncode == 0, out.stderr
    assert read_pair(tmp_path / "rec_text_document") == one_off

    out = megacli("preprocess", "merge", tmp_path / "cli_text_document", tmp_path / "rec_text_document.idx",
                  "--output", tmp_path / "both")
    assert out.returncode == 0, out.stderr
    assert "240 documents" in out.stdout
    assert indexed.read_index(str(tmp_path / "both")).document_count == 240

    out = megacli("preprocess", "inspect", tmp_path / "cli_text_document", "--tokenizer", hf_dir, "--docs", "2")
    assert out.returncode == 0, out.stderr
    assert "uint16" in out.stdout and "document length" in out.stdout and "120" in out.stdout
    first = json.loads(corpus.read_text(encoding="utf-8").splitlines()[0])["text"]
    assert first[:30] in out.stdout.replace("\n", " ") or first[:15] in out.stdout


def test_cli_errors_are_one_message_exit_2(tmp_path):
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    runner = CliRunner()

    def cli(*args):
        return runner.invoke(app, [str(a) for a in args])

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n', encoding="utf-8")
    out = cli("preprocess", "--input", bad, "--output-prefix", tmp_path / "o", "--tokenizer", "byte", "--workers", "0")
    assert out.exit_code == 2 and f"{bad}:2" in out.stderr and "Traceback" not in out.output
    out = cli("preprocess", "--input", bad, "--output-prefix", tmp_path / "o", "--skip-bad-records", "--workers", "0")
    assert out.exit_code == 0 and "skipped 1 bad record" in out.stderr
    out = cli("preprocess", "--input", bad, "--output-prefix", tmp_path / "o", "--keep-newlines")
    assert out.exit_code == 2 and "keep_newlines" in out.stderr
    out = cli("preprocess", "--input", tmp_path / "missing.jsonl", "--output-prefix", tmp_path / "o")
    assert out.exit_code == 2 and "missing.jsonl" in out.stderr
    out = cli("preprocess")
    assert out.exit_code == 2 and "--input" in out.stderr
    out = cli("preprocess", "inspect", tmp_path / "nothing")
    assert out.exit_code == 2 and "nothing" in out.stderr


def test_ctrl_c_removes_partial_files(tmp_path, hf_dir):
    import signal
    import time

    big = write_jsonl(tmp_path / "big.jsonl", make_corpus(6000, seed=2))
    proc = subprocess.Popen([sys.executable, "-m", "megacli", "preprocess", "--input", str(big), "--output-prefix",
                             str(tmp_path / "out"), "--tokenizer", str(hf_dir), "--workers", "2", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list(tmp_path.glob("out*.partial")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    if proc.poll() is not None:
        pytest.skip("the run finished before it could be interrupted")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["big.jsonl"]


def test_a_worker_that_fails_or_dies_stops_the_run_with_no_partial_files(tmp_path, corpus, monkeypatch):
    """A worker's error is raised in the parent; a worker that dies (killed, out of memory) stops the
    run with its exit code rather than leaving the parent waiting for its chunk."""
    import os

    from megacli.data import preprocess_workers

    def fail(chunk):
        raise ValueError(f"cannot encode line {chunk.first_line}")

    monkeypatch.setattr(preprocess_workers, "encode_chunk", fail)  # the forked workers call this one
    with pytest.raises(ValueError, match="cannot encode line"):
        run(job([corpus], tmp_path / "out", workers=2, chunk_mb=0.001))
    monkeypatch.setattr(preprocess_workers, "encode_chunk", lambda chunk: os._exit(3))
    with pytest.raises(RuntimeError, match=r"worker \d+ died \(exit code 3\)"):
        run(job([corpus], tmp_path / "out", workers=2, chunk_mb=0.001))
    assert list(tmp_path.iterdir()) == []


# ---- Megatron-LM's spellings and --dry-run ----
def _cli(*args):
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})  # long tmp paths must not wrap


def test_megatron_lm_spellings_write_what_megacli_spellings_write(tmp_path, corpus, hf_dir):
    ours = _cli("preprocess", "--input", corpus, "--output-prefix", tmp_path / "ours", "--json-keys", "text",
                "--json-keys", "title", "--tokenizer", hf_dir, "--append-eod", "--workers", "0", "--no-progress")
    assert ours.exit_code == 0, ours.output
    theirs = _cli("preprocess", "--input", corpus, "--output-prefix", tmp_path / "theirs", "--json-keys", "text", "title",
                  "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir, "--append-eod", "--workers", "0",
                  "--partitions", "2", "--log-interval", "10", "--keep-sequential-samples", "--no-progress")
    assert theirs.exit_code == 0, theirs.output
    for key in ("text", "title"):
        assert read_pair(tmp_path / f"theirs_{key}_document") == read_pair(tmp_path / f"ours_{key}_document")


def test_json_keys_values_end_at_a_recipe(tmp_path, corpus):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"preprocess:\n  input: {corpus}\n  output_prefix: {tmp_path / 'o'}\n")
    out = _cli("preprocess", "--json-keys", "text", "title", recipe, "--dry-run")
    assert out.exit_code == 0, out.output
    assert "json_keys:\n  - text\n  - title\n" in out.output


def test_megatron_wordpiece_types_must_agree_with_the_vocabulary_casing(tmp_path, corpus):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "quick", "."]) + "\n")
    out = _cli("preprocess", "--input", corpus, "--output-prefix", tmp_path / "wp", "--tokenizer-type",
               "BertWordPieceLowerCase", "--vocab-file", vocab, "--workers", "0", "--no-progress")
    assert out.exit_code == 0, out.output
    out = _cli("preprocess", "--input", corpus, "--output-prefix", tmp_path / "wp", "--tokenizer-type",
               "BertWordPieceCase", "--vocab-file", vocab)
    assert out.exit_code == 2 and "uncased vocabulary" in out.output and "BertWordPieceLowerCase" in out.output


def test_megatron_gpt2_bpe_reads_the_tokenizer_json_beside_vocab_and_merges(tmp_path, corpus, hf_dir):
    import shutil

    gpt2 = tmp_path / "gpt2"
    shutil.copytree(hf_dir, gpt2)
    for name in ("vocab.json", "merges.txt"):
        (gpt2 / name).touch()
    out = _cli("preprocess", "--input", corpus, "--output-prefix", tmp_path / "g", "--tokenizer-type", "GPT2BPETokenizer",
               "--vocab-file", gpt2 / "vocab.json", "--merge-file", gpt2 / "merges.txt", "--dry-run")
    assert out.exit_code == 0, out.output
    assert f"type: huggingface\n  path: {gpt2}\n" in out.output
    (gpt2 / "tokenizer.json").unlink()
    out = _cli("preprocess", "--input", corpus, "--output-prefix", tmp_path / "g", "--tokenizer-type", "GPT2BPETokenizer",
               "--vocab-file", gpt2 / "vocab.json", "--merge-file", gpt2 / "merges.txt")
    assert out.exit_code == 2 and "tokenizer.json" in out.output and "Traceback" not in out.output


@pytest.mark.parametrize("args, words", [
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "x.model"], "GPTSentencePieceTokenizer"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "x"], "no TikTokenizer"),
    (["--tokenizer-type", "MagicTokenizer"], "expected one of HuggingFaceTokenizer"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "needs --tokenizer-model"),
    (["--tokenizer-type", "BertWordPieceCase", "--vocab-file", "v.txt", "--merge-file", "m.txt"], "--merge-file: --tokenizer-type BertWordPieceCase does not use it"),
    (["--tokenizer", "byte", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "x"], "not both"),
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "x.model", "--split-sentences"], "a BOS before every sentence"),
    (["--tokenizer-type", "NullTokenizer"], "needs a real tokenizer"),
    *[([option, "1"], f"{option}: an option of Megatron-LM's preprocess_data.py that megacli preprocess does not have")
      for option in ("--vocab-size", "--vocab-extra-ids", "--tiktoken-pattern")],
    # not options of every checked release's preprocess_data.py (benchmarks/megatron_lm_args_check.py): said so
    *[([option, "1"], f"{option}: an option of Megatron-LM's preprocess_data.py (in versions {when}) that megacli "
                      f"preprocess does not have")
      for option, when in (("--find-optimal-num-workers", "after core_v0.16.1"), ("--workers-to-check", "after core_v0.16.1"),
                           ("--max-documents", "after core_v0.16.1"), ("--performance-dir", "after core_v0.19.0"),
                           ("--tiktoken-special-tokens", "before core_v0.19.0"), ("--dataset-impl", "before core_v0.16.1"))],
])
def test_megatron_options_megacli_lacks_are_named_not_misread(tmp_path, corpus, args, words):
    out = _cli("preprocess", "--input", corpus, "--output-prefix", tmp_path / "o", *args)
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    assert words in " ".join(out.output.split()), out.output
    assert not list(tmp_path.iterdir())


def test_megatron_llama2_tokenizer_adds_a_bos(tmp_path, corpus):
    import sentencepiece as spm

    text_file = tmp_path / "train.txt"
    text_file.write_text("\n".join(SENTENCES * 20), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text_file), model_prefix=str(tmp_path / "sp"), vocab_size=120,
                                   model_type="bpe", minloglevel=2)
    out = _cli("preprocess", "--input", corpus, "--output-prefix", tmp_path / "o", "--tokenizer-type", "Llama2Tokenizer",
               "--tokenizer-model", tmp_path / "sp.model", "--dry-run")
    assert out.exit_code == 0, out.output
    assert "add_bos: true" in out.output and "type: sentencepiece" in out.output and "BOS first" in out.output


def test_dry_run_shows_inputs_tokenizer_and_outputs_and_writes_nothing(tmp_path, corpus, hf_dir):
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(corpus.read_text(encoding="utf-8"))
    (tmp_path / "o_text_document.bin").write_bytes(b"")
    before = sorted(tmp_path.iterdir())
    out = _cli("preprocess", "--input", corpus, "--input", gz, "--output-prefix", tmp_path / "o", "--tokenizer", hf_dir,
               "--json-keys", "text", "title", "--dry-run")
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert out.output.startswith("preprocess:\n  input:\n")
    assert f"{corpus.stat().st_size / 1e3:.1f} kB" in text and "jsonl (gzip)" in text
    assert re.search(r"│ total │ │ [\d.]+ kB │ 240 │", text), text
    assert f"path │ {hf_dir}" in text and "vocabulary │ 400 ids" in text
    assert "exist: would be replaced" in text and "o_title_document.idx" in text
    assert sorted(tmp_path.iterdir()) == before


def test_record_counts_of_large_line_files_are_sampled(tmp_path):
    from megacli.data.readers import resolve_sources
    from megacli.data.survey import RecordCount, count_records

    records = make_corpus(20000)  # big enough that gzip's start-up is a small part of the sample
    plain = write_jsonl(tmp_path / "big.jsonl", records)
    gz = tmp_path / "big.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(plain.read_text(encoding="utf-8"))
    for path in (plain, gz):
        source = resolve_sources([str(path)])[0]
        assert count_records(source, document_per_line=True) == RecordCount(20000, True)
        sampled = count_records(source, document_per_line=True, sample_bytes=path.stat().st_size // 5)
        assert not sampled.exact and abs(sampled.records - 20000) < 1000, (path, sampled)
