"""Indexed data that would hang or crash Megatron's datasets is refused before training, with
the file and the cause named (exit 2, no traceback)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from megacli.data import indexed
from megacli.errors import UserError
from tests.conftest import pretrain

TINY = [
    "data.mock=false", "tokenizer.type=byte", "tokenizer.path=null",
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
    "model.seq_length=32", "train.iters=2", "train.micro_batch_size=2", "train.global_batch_size=2",
    "train.eval_interval=null", "optim.warmup_iters=0", "train.precision=fp32", "checkpoint.dir=null",
    "parallel.tensor=1", "parallel.pipeline=1", "parallel.sequence_parallel=false", "parallel.virtual_pipeline=null",
    "launch.nproc=1",
]


def corpus(prefix: Path, docs: int, tokens: int) -> str:
    rng = np.random.default_rng(0)
    with indexed.IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(docs):
            w.add_document(rng.integers(0, 250, tokens).tolist())
        w.commit()
    return str(prefix)


def run(tmp: Path, overrides: list[str], timeout=120) -> subprocess.CompletedProcess:
    """`megacli pretrain` of TINY with the overrides into TMP/run in a fresh interpreter (nothing may
    be printed at its exit either), finished however it finished."""
    return pretrain(tmp / "run", [*TINY, *overrides], check=False, timeout=timeout, fresh=True)


@pytest.mark.parametrize("docs,split", [(3, "98,2,0"), (1, "969,30,1")])
def test_split_without_documents_is_refused_not_hung(tmp_path, docs, split):
    """3 documents with 98,2,0 leave the validation split empty; Megatron loops forever on it."""
    prefix = corpus(tmp_path / "c", docs, 440)
    out = run(tmp_path, [f"data.path={prefix}", f"data.split={split}"])
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert f"{docs} documents" in out.stderr and "split 0 documents" in out.stderr and "data.split" in out.stderr


def test_split_shorter_than_one_sequence_is_refused(tmp_path):
    prefix = corpus(tmp_path / "c", 50, 1)  # the validation split: 1 document of 1 token < seq_length + 1
    with pytest.raises(UserError, match="validation split 1 documents and 1 tokens; it needs at least 1 document and 33"):
        from megacli.engine.data import check_splits

        check_splits([prefix], "98,2,0", min_tokens=33)


def damage(prefix: str, kind: str) -> str:
    """Break a good dataset; returns the file the error must name."""
    bin_file, idx_file = indexed.bin_path(prefix), indexed.idx_path(prefix)
    if kind == "truncated bin":
        data = Path(bin_file).read_bytes()
        Path(bin_file).write_bytes(data[:len(data) // 2])
        return bin_file
    if kind == "bad idx header":
        data = bytearray(Path(idx_file).read_bytes())
        data[:4] = b"XXXX"
        Path(idx_file).write_bytes(bytes(data))
        return idx_file
    if kind == "empty idx":
        Path(idx_file).write_bytes(b"")
        return idx_file
    if kind == "empty bin":
        Path(bin_file).write_bytes(b"")
        return bin_file
    if kind == "bad pointers":
        index = indexed.read_index(prefix)
        offset = indexed.HEADER_BYTES + index.sequence_count * 4 + 8  # the second sequence's pointer
        data = bytearray(Path(idx_file).read_bytes())
        data[offset:offset + 8] = np.int64(7).tobytes()
        Path(idx_file).write_bytes(bytes(data))
        return idx_file
    raise ValueError(kind)


KINDS = ["truncated bin", "bad idx header", "empty idx", "empty bin", "bad pointers"]


@pytest.mark.parametrize("kind", KINDS)
def test_validate_names_the_broken_file(tmp_path, kind):
    prefix = corpus(tmp_path / "c", 20, 100)
    named = damage(prefix, kind)
    with pytest.raises(UserError) as err:
        indexed.validate(prefix)
    assert str(err.value).startswith(named), err.value


def test_truncated_bin_is_a_clear_error_before_training(tmp_path):
    prefix = corpus(tmp_path / "c", 200, 100)
    named = damage(prefix, "truncated bin")
    out = run(tmp_path, [f"data.path={prefix}", "data.split=98,2,0"])
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr
    assert named in out.stderr.replace("\n", "") and "truncated" in out.stderr


@pytest.mark.parametrize("which", ["bin", "idx"])
def test_a_fifo_in_place_of_a_shard_is_named_as_one_not_missing_nor_waited_on(tmp_path, which):
    import os

    prefix = corpus(tmp_path / "c", 20, 100)
    shard = indexed.bin_path(prefix) if which == "bin" else indexed.idx_path(prefix)
    os.remove(shard)
    os.mkfifo(shard)
    for read in (indexed.validate, lambda p: indexed.merge([p], str(tmp_path / "merged"))):
        with pytest.raises(UserError) as err:
            read(prefix)
        assert f"{shard}: a FIFO (named pipe), not a regular file" in str(err.value), err.value
    assert not list(tmp_path.glob("merged*"))


def test_a_fifo_given_as_an_input_file_is_named_not_waited_on(tmp_path):
    """preprocess inputs, on-the-fly data.files and the line files (preference pairs, prompts)."""
    import os

    from megacli.data.jsonl import iter_lines
    from megacli.data.readers import iter_records
    from megacli.data.stream import jsonl_paths

    fifo = tmp_path / "docs.jsonl"
    os.mkfifo(fifo)
    for read in (lambda: list(iter_records([str(fifo)])), lambda: jsonl_paths([str(fifo)]),
                 lambda: list(iter_lines(fifo))):
        with pytest.raises(UserError) as err:
            read()
        assert "a FIFO (named pipe), not a regular file" in str(err.value) and str(fifo) in str(err.value), err.value
