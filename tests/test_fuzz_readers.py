"""Property tests: every reader of a file megacli takes from outside (recipes, data, run
directories, checkpoints, Hugging Face indexes) fed random bytes and mutations of a good file
gives a correct result or a clean error (UserError / RecipeErrors: one message, exit 2), never
another exception, a hang, or code run from the file. In-process, deterministic (the "megacli"
profile of tests/conftest.py), a few seconds each."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import pickle
import signal
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, strategies as st  # noqa: E402

from megacli.checkpoint.source import Source  # noqa: E402
from megacli.errors import UserError  # noqa: E402
from megacli.recipe.base import RecipeErrors  # noqa: E402

SECONDS = 10  # one example longer than this is a hang


@contextlib.contextmanager
def bounded(seconds: float = SECONDS):
    """Fail an example that runs longer than ``seconds`` (a hang) instead of waiting for it."""
    def hang(*_):
        raise AssertionError(f"no answer after {seconds} s: the reader hangs")

    old = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def outcome(read, *args, **kwargs):
    """``read(*args)``'s result, or None when it refused the input cleanly; any other exception fails."""
    with bounded():
        try:
            return read(*args, **kwargs)
        except (UserError, RecipeErrors) as exc:
            assert str(exc).strip(), "an error with no message"
            return None


@st.composite
def mutated(draw, good: bytes):
    """``good`` with a few random edits: bytes flipped, cut off, inserted or deleted."""
    data = bytearray(good)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif data:
            del data[at:at + draw(st.integers(1, 16))]
    return bytes(data)


def inputs(good: bytes, max_size: int = 512):
    """Random bytes, or a mutation of a good file."""
    return st.one_of(st.binary(max_size=max_size), mutated(good))


# ---------------------------------------------------------------- recipes


def _good_recipe() -> bytes:
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    return base.dump(base.load(TrainingRecipe, None, ["data.mock=true"])).encode()


GOOD_RECIPE = _good_recipe()


@given(inputs(GOOD_RECIPE) | st.text(max_size=300).map(str.encode))
@example(b"train:\n  iters: 5\n  iters: 7\n")
@example(b"a: &a [*a, *a]\n")
def test_recipe_yaml(tmp_path, data):
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    path = tmp_path / "recipe.yaml"
    path.write_bytes(data)
    outcome(base.load, TrainingRecipe, path)


@given(inputs(GOOD_RECIPE))
@example(b"- a list\n")
@example(b"model: [1, 2]\n")
def test_a_checkpoints_recipe_in_the_resume_check(tmp_path, data):
    from megacli.engine.compat import check_resumable
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    (tmp_path / "recipe.yaml").write_bytes(data)
    outcome(check_resumable, tmp_path, base.load(TrainingRecipe, None, ["data.mock=true"]))


@given(st.text(max_size=60))
def test_set_overrides(value):
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    outcome(base.load, TrainingRecipe, None, ["data.mock=true", f"train.iters={value}"])


ALIAS_BOMB = b"".join(b"%c: &%c [" % (97 + i, 97 + i) + b", ".join([b"*%c" % (96 + i) if i else b"lol"] * 9) + b"]\n"
                     for i in range(9)) + b"train:\n  iters: *i\n"  # 12 lines, 8 levels of 9 aliases


@given(inputs(GOOD_RECIPE) | st.text(max_size=300).map(str.encode))
@example(ALIAS_BOMB)
@example(b"model:\n  arch: \xff\xfe\n")
@example(b"run:\n  name: \"a\\x00b\\nc\"\n")
def test_recipe_yaml_with_aliases_and_control_characters(tmp_path, data):
    """A recipe's aliases past the budget are refused quickly, with a message of readable length."""
    from megacli.errors import readable
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    path = tmp_path / "recipe.yaml"
    path.write_bytes(data)
    try:
        with bounded(5):
            base.load(TrainingRecipe, path)
    except RecipeErrors as exc:
        assert len(readable(exc.render())) < 20_000
        assert data != ALIAS_BOMB or "aliases expand this document" in exc.render()


GOOD_TASK = (b"task: t\ndataset_path: json\noutput_type: loglikelihood\ndoc_to_text: \"{{text}}\"\n"
             b"doc_to_target: \"{{label}}\"\nmetric_list:\n  - {metric: acc}\n")


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-evaluation-harness (the eval extra)")
@given(inputs(GOOD_TASK) | st.text(max_size=200).map(lambda t: GOOD_TASK + t.encode()))
@example(GOOD_TASK + ALIAS_BOMB.replace(b"train:\n  iters: *i", b"doc_to_choice: *i"))
@example(GOOD_TASK + b"process_docs: !function utils.process\n")
@example(b"task: \xff\xfe\n")
@example(b"task: t\x07\ninclude: [x.yaml, *x]\n")
def test_task_yaml_scan(tmp_path, data):
    """The scan of an include path's task YAMLs (before the harness reads them) finds the code they
    name, or refuses a file it cannot read as the harness would (an alias bomb, bytes that are not
    UTF-8, control characters): never another exception or a hang."""
    import lm_eval.api.metrics  # noqa: F401 - the scan's imports, before the clock of `outcome` starts
    import lm_eval.tasks  # noqa: F401

    from megacli.inference.task_code import task_code

    (tmp_path / "t.yaml").write_bytes(data)
    found = outcome(task_code, tmp_path)
    if b"doc_to_choice: *i" in data:
        assert found is None  # the bomb is refused
    if found is not None and b"!function utils.process" in data:
        assert any("!function utils.process" in line for line in found), found


# ---------------------------------------------------------------- data


GOOD_JSONL = b'{"text": "one document"}\n{"text": "two", "id": 2}\n{"text": "caf\xc3\xa9"}\n'


@given(inputs(GOOD_JSONL))
@example(b'{"text": 12345}\n')
def test_preprocess_jsonl_reader(tmp_path, data):
    from megacli.data.readers import iter_records

    path = tmp_path / "docs.jsonl"
    path.write_bytes(data)
    records = outcome(lambda: list(iter_records([str(path)])))
    if records is not None:
        assert all(isinstance(r["text"], str) for _, _, r in records)


def _good_parquet(path: Path) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", "two", "three"]}), path)
    return path.read_bytes()


@given(data=st.data())
def test_preprocess_parquet_reader(tmp_path, data):
    from megacli.data.readers import iter_records

    path = tmp_path / "docs.parquet"
    good = _good_parquet(path)
    path.write_bytes(data.draw(inputs(good, max_size=256)))
    records = outcome(lambda: list(iter_records([str(path)])))
    if records is not None:
        assert all(isinstance(r["text"], str) for _, _, r in records)


# Valid UTF-8 only: a non-UTF-8 line in an on-the-fly source is #29 item 11, handled elsewhere.
@given(st.lists(st.one_of(st.text(max_size=30), st.builds(json.dumps, st.dictionaries(
    st.sampled_from(["text", "id"]), st.one_of(st.text(max_size=10), st.integers(), st.none(), st.booleans())))),
    max_size=6).map(lambda lines: "\n".join(lines).encode()))
def test_on_the_fly_jsonl_reader(tmp_path, data):
    from megacli.data.stream import texts
    from megacli.recipe.stream import StreamSource

    path = tmp_path / "docs.jsonl"
    path.write_bytes(data)
    found = outcome(lambda: list(texts(StreamSource(source="jsonl", files=[str(path)]))))
    if found is not None:
        assert all(isinstance(t, str) for t in found)


def _good_idx(prefix: Path) -> bytes:
    from megacli.data import indexed

    with indexed.IndexedDatasetWriter(prefix, np.uint16) as w:
        for doc in ([1, 2, 3], [4, 5], [6]):
            w.add_document(doc)
        w.commit()
    return Path(indexed.idx_path(prefix)).read_bytes()


@given(data=st.data())
def test_indexed_dataset_index(tmp_path, data):
    from megacli.data import indexed

    prefix = tmp_path / "corpus"
    good = _good_idx(prefix)
    Path(indexed.idx_path(prefix)).write_bytes(data.draw(inputs(good, max_size=200)))
    index = outcome(indexed.validate, str(prefix))
    if index is not None:  # what passes the check reads back within the .bin
        tokens = [indexed.read_document(str(prefix), index, d) for d in range(index.document_count)]
        assert sum(len(t) for t in tokens) == index.total_tokens


# ---------------------------------------------------------------- run directories


GOOD_METRICS = (b'{"iteration": 1, "loss": 5.0, "lr": 0.001}\n{"iteration": 2, "val_loss": 4.5}\n'
                b'{"iteration": 2, "loss": 4.0, "grad_norm": null}\n')


@given(inputs(GOOD_METRICS))
@example(b'{"iteration": 1, "loss": Infinity}\n{"iteration": 2, "loss": NaN}\n{"iteration": 3, "loss": 1e308}\n')
@example(b'{"iteration": 99999999999999999999999, "loss": 1}\n')
def test_metrics_jsonl_and_its_text_plot(tmp_path, data):
    from megacli.plot.series import choose_metrics, read_runs
    from megacli.plot.text import text_chart

    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "metrics.jsonl").write_bytes(data)
    runs = outcome(read_runs, [run_dir])
    if runs is not None:
        outcome(choose_metrics, runs, None)
        assert outcome(text_chart, runs, "loss")


GOOD_META = json.dumps({"iteration": 4, "consumed_samples": 32, "run_id": "ab", "lora": {"base": "x"}}).encode()


@given(inputs(GOOD_META, max_size=64))
@example(b"[]")
@example(b'{"lora": []}')
def test_megacli_json(tmp_path, data):
    from megacli.checkpoint.layout import lora_base_of, read_meta

    (tmp_path / "megacli.json").write_bytes(data)
    meta = outcome(read_meta, tmp_path)
    if meta is not None:
        assert isinstance(meta, dict)
        outcome(lora_base_of, tmp_path)


GOOD_MANIFEST = json.dumps({"algorithm": "xxh3_64", "files": {"a.bin": {"size": 3, "xxh3_64": "0"}}}).encode()


@given(inputs(GOOD_MANIFEST, max_size=96))
@example(b'{"files": []}')
@example(b'{"files": {"a.bin": 3}}')
@example(b'{"files": {"../../etc/passwd": {"size": 1, "xxh3_64": "0"}}}')
def test_checkpoint_manifest(tmp_path, data):
    from megacli.checkpoint import manifest

    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "manifest.json").write_bytes(data)
    found = outcome(manifest.problems, tmp_path)
    assert found is None or all(isinstance(p, str) for p in found)


@given(inputs(b'{"wandb": "abc123", "mlflow": "0f"}', max_size=64))
def test_trackers_json(tmp_path, data):
    from megacli.engine.trackers import Trackers

    (tmp_path / "trackers.json").write_bytes(data)
    outcome(Trackers, names=[], run_dir=str(tmp_path), run_name=None, recipe={}, versions={}, resumed=True,
            warn=lambda _: None)


# ---------------------------------------------------------------- checkpoints


def _torch_dist_dir(root: Path) -> Path:
    """A torch_dist checkpoint directory (a tensor and a pickled object), written once per test."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    ckpt = root / "dcp"
    if not ckpt.exists():
        with warnings.catch_warnings():  # torch warns that it saves without a process group
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.arange(4.0), "extra": {"step": 3}}, checkpoint_id=str(ckpt), no_dist=True)
        (root / "good.metadata").write_bytes((ckpt / ".metadata").read_bytes())
    return ckpt


MARKER = "megacli-fuzz-marker"


class _Payload:
    """A pickle that, when loaded without an allow-list, calls ``func(*args)``."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _payloads(marker: Path):
    import builtins
    import os
    import subprocess

    touch = f"open({str(marker)!r}, 'w').close()"
    return [(os.system, (f"touch {marker}",)), (builtins.exec, (touch,)), (builtins.eval, (touch,)),
            (subprocess.call, (["touch", str(marker)],)), (builtins.open, (str(marker), "w"))]


@given(data=st.data())
def test_torch_dist_metadata_through_the_allow_list(tmp_path, data):
    from megacli.checkpoint.safe_pickle import check_torch_dist

    ckpt = _torch_dist_dir(tmp_path)
    good = (tmp_path / "good.metadata").read_bytes()
    marker = tmp_path / MARKER
    func, args = data.draw(st.sampled_from(_payloads(marker)))
    hostile = pickle.dumps(_Payload(func, args), protocol=data.draw(st.integers(2, 5)))
    (ckpt / ".metadata").write_bytes(data.draw(st.one_of(inputs(good, max_size=256), st.just(hostile),
                                                         mutated(hostile))))
    metadata = outcome(check_torch_dist, ckpt, trust=False)
    assert not marker.exists(), "the file ran code"
    if metadata is not None:
        from torch.distributed.checkpoint.metadata import Metadata

        assert isinstance(metadata, Metadata)


@given(data=st.data())
def test_common_pt_through_the_allow_list(tmp_path, data):
    import argparse

    import torch

    from megacli.checkpoint.safe_pickle import torch_load

    path = tmp_path / "common.pt"
    torch.save({"args": argparse.Namespace(num_layers=2), "w": torch.ones(3), "n": np.int64(3)}, path)
    good = path.read_bytes()
    marker = tmp_path / MARKER
    func, args = data.draw(st.sampled_from(_payloads(marker)))
    torch.save({"args": _Payload(func, args)}, path)
    hostile = path.read_bytes()
    path.write_bytes(data.draw(st.one_of(inputs(good, max_size=256), st.just(hostile), mutated(hostile))))
    outcome(torch_load, path, trust=False, name=path)
    assert not marker.exists(), "the file ran code"


def _hf_dir(root: Path) -> None:
    import torch
    from safetensors.torch import save_file

    root.mkdir(exist_ok=True)
    (root / "config.json").write_text("{}")
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(root / "model-00001-of-00001.safetensors"))


GOOD_INDEX = json.dumps({"metadata": {"total_size": 20}, "weight_map": {"a": "model-00001-of-00001.safetensors",
                                                                        "b": "model-00001-of-00001.safetensors"}}).encode()


@given(inputs(GOOD_INDEX, max_size=128))
@example(b"[]")
@example(b'{"weight_map": ["model-00001-of-00001.safetensors"]}')
@example(b'{"weight_map": {"a": "../outside.safetensors"}}')
def test_safetensors_index(tmp_path, data):
    from megacli.convert.hf_io import SAFE_INDEX, HFWeights

    root = tmp_path / "hf"
    _hf_dir(root)
    (root / SAFE_INDEX).write_bytes(data)
    weights = outcome(HFWeights, Source(root))
    if weights is not None:
        assert set(weights._where) <= {"a", "b"}


@given(data=st.data())
def test_safetensors_header(tmp_path, data):
    from megacli.convert.hf_io import read_safetensors_header

    root = tmp_path / "hf"
    _hf_dir(root)
    shard = root / "model-00001-of-00001.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(data.draw(inputs(good, max_size=128)))
    found = outcome(read_safetensors_header, shard)
    if found is not None:
        header, start = found
        assert isinstance(header, dict) and start >= 8


# ---------------------------------------------------------------- what the properties found, as plain examples


def test_a_parquet_file_damaged_after_its_footer_is_named(tmp_path):
    from megacli.data.readers import iter_records

    path = tmp_path / "docs.parquet"
    data = bytearray(_good_parquet(path))
    data[4:40] = bytes(36)  # the first data page's header, behind a footer that still reads
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"{path}: corrupt Parquet data after row 0"):
        list(iter_records([str(path)]))


@pytest.mark.parametrize("content, expected", [
    (b"[]", "not a checkpoint record"),
    (b'{"lora": {"base": 3}}', "lora.base = 3 is not a path"),
])
def test_a_megacli_json_that_is_not_a_record_is_named(tmp_path, content, expected):
    from megacli.checkpoint.layout import lora_base_of

    (tmp_path / "megacli.json").write_bytes(content)
    with pytest.raises(UserError, match=expected):
        lora_base_of(tmp_path)


@pytest.mark.parametrize("files", [[], {"a.bin": 3}, {"a.bin": {"size": "3", "xxh3_64": "0"}},
                                   {"../a.bin": {"size": 3, "xxh3_64": "0"}}])
def test_a_malformed_manifest_is_one_problem_not_a_traceback(tmp_path, files):
    from megacli.checkpoint import manifest

    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "manifest.json").write_text(json.dumps({"algorithm": "xxh3_64", "files": files}))
    assert manifest.problems(tmp_path) == [f"{tmp_path / 'manifest.json'}: not a readable manifest (files must map "
                                           f"names inside the checkpoint to their size and xxh3_64)"]


@pytest.mark.parametrize("index", [b"[]", b'{"weight_map": ["model-00001-of-00001.safetensors"]}'])
def test_a_safetensors_index_without_a_weight_map_is_named(tmp_path, index):
    from megacli.convert.hf_io import SAFE_INDEX, HFWeights

    _hf_dir(tmp_path)
    (tmp_path / SAFE_INDEX).write_bytes(index)
    with pytest.raises(UserError, match="no weight_map"):
        HFWeights(Source(tmp_path))


@pytest.mark.parametrize("header, expected", [
    ((1 << 40).to_bytes(8, "little") + b"{}", "header length 1099511627776 runs past the end"),
    ((2).to_bytes(8, "little") + b"[]", "header is not a JSON object"),
])
def test_a_safetensors_header_is_checked_before_it_is_read(tmp_path, header, expected):
    from megacli.convert.hf_io import read_safetensors_header

    shard = tmp_path / "model.safetensors"
    shard.write_bytes(header)
    with pytest.raises(UserError, match=expected):
        read_safetensors_header(shard)


def test_a_tensor_shard_that_is_a_hostile_pickle_is_refused_by_megacli_not_torch(tmp_path):
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from megacli.checkpoint.torch_dist import TorchDistReader

    ckpt = _torch_dist_dir(tmp_path)
    marker = tmp_path / MARKER
    evil = ckpt / "evil.distcp"
    torch.save(_Payload(*_payloads(marker)[1]), evil)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn == "w")
    metadata.storage_data[index] = _StorageInfo(relative_path="evil.distcp", offset=0, length=evil.stat().st_size)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError) as info:
        TorchDistReader(Source(ckpt)).read("w")
    message = str(info.value)
    assert "refused to unpickle builtins.exec" in message and "evil.distcp" in message, message
    assert "Weights only load failed" not in message and not marker.exists()


@pytest.mark.parametrize("content", [b"[]", b"{not json"])
def test_a_malformed_metadata_json_beside_a_torch_dist_checkpoint_is_named(tmp_path, content):
    from megacli.checkpoint.torch_dist import TorchDistReader

    ckpt = _torch_dist_dir(tmp_path)
    (ckpt / "metadata.json").write_bytes(content)
    with pytest.raises(UserError, match="metadata.json"):
        TorchDistReader(Source(ckpt))


@pytest.mark.parametrize("content, expected", [(b"- a list\n", "not a recipe"), (b"model: [1,\n", "cannot read")])
def test_a_checkpoints_recipe_that_is_not_a_recipe_is_named_on_resume(tmp_path, content, expected):
    from megacli.engine.compat import check_resumable
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    (tmp_path / "recipe.yaml").write_bytes(content)
    with pytest.raises(UserError, match=rf"{tmp_path / 'recipe.yaml'}: {expected}"):
        check_resumable(tmp_path, base.load(TrainingRecipe, None, ["data.mock=true"]))


# ---------------------------------------------------------------- the shared line reader (data/jsonl.py)


GOOD_PAIRS = (b'{"prompt": "a", "chosen": "b", "rejected": "c", "response": "d", "text": "e"}\n'
              b'{"prompt": "caf\xc3\xa9", "chosen": "x\\u0000y", "rejected": "\\u001b[31m", "response": "r", "text": "t"}\n')
# Lines as they come: JSON records whose strings hold control characters, raw control bytes, bytes that are not UTF-8.
LINE = st.one_of(st.builds(lambda d: json.dumps(d).encode(), st.fixed_dictionaries(
    {k: st.text(alphabet=st.characters(max_codepoint=0x2030), max_size=8)
     for k in ("prompt", "chosen", "rejected", "response", "text")})),
    st.binary(max_size=24), st.sampled_from([b"\xff\xfe", b"\x00", b"\x1b[2J", b"\xef\xbb\xbf", b"\r", b"\xe2\x80\xa8"]))


@given(inputs(GOOD_PAIRS) | st.lists(LINE, max_size=5).map(b"\n".join))
@example(b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "\xff"}\n')
@example(b"[" * 100_000)
def test_the_line_reader_behind_preference_sft_and_generate_files(tmp_path, data):
    from megacli.data.jsonl import iter_lines
    from megacli.data.preference import read_pairs
    from megacli.data.sft import read_records
    from megacli.inference.job import read_texts

    path = tmp_path / "lines.jsonl"
    path.write_bytes(data)
    records = outcome(lambda: list(iter_lines(path)))
    lines = [line.removesuffix(b"\r") for line in data.removeprefix(b"\xef\xbb\xbf").split(b"\n")]
    if records is not None:  # exactly the lines that hold something, parsed, named by their number
        kept = [(n, line) for n, line in enumerate(lines, 1) if line.decode().strip()]
        assert [where for where, _ in records] == [f"{path}:{n}" for n, _ in kept]
        assert [record for _, record in records] == [json.loads(line.decode()) for _, line in kept]
    for read in (read_pairs, read_records):
        found = outcome(read, str(path))
        assert found is None or found  # a file with nothing to read is refused, not an empty result
    texts = outcome(read_texts, str(path), "prompt")
    assert texts is None or all(isinstance(t, str) for t in texts)


# ---------------------------------------------------------------- Hugging Face config.json (checkpoint/hf_config.py)


GOOD_CONFIG = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
                          "intermediate_size": 16, "max_position_embeddings": 16, "vocab_size": 64}).encode()
ODD_VALUES = st.one_of(st.integers(-3, 20), st.floats(allow_nan=True), st.booleans(), st.none(),
                       st.text(max_size=6), st.lists(st.integers(0, 4), max_size=2))


@given(inputs(GOOD_CONFIG) | st.dictionaries(st.sampled_from(
    ["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size",
     "head_dim", "vocab_size", "max_position_embeddings", "architectures", "num_experts"]), ODD_VALUES, max_size=5).map(
    lambda edits: json.dumps({**json.loads(GOOD_CONFIG), **edits}).encode()))
@example(b'"a string"')
@example(b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 0}')
@example(b'{"architectures": ["LlamaForCausalLM\\u0000\\u001b"], "hidden_size": "8\\n"}')
def test_hf_config_json(tmp_path, data):
    """Accepted: every size a positive integer, heads dividing the hidden size, groups dividing the
    heads; and the family's mapping of it then gives a model section or a clean error."""
    from megacli.convert import families
    from megacli.checkpoint.hf_config import POSITIVE, read_config

    path = tmp_path / "config.json"
    path.write_bytes(data)
    config = outcome(read_config, path)
    if config is None:
        return
    assert all(type(config[k]) is int and config[k] > 0 for k in POSITIVE if config.get(k) is not None)
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if hidden and heads and config.get("head_dim") is None:
        assert hidden % heads == 0
    outcome(lambda: families.for_hf_config(config)[0].model_section(config))


# ---------------------------------------------------------------- the preference cache (engine/array_files.py)


def _good_cache(path: Path) -> bytes:
    np.save(path, -np.arange(8, dtype=np.float64).reshape(4, 2) - 0.5)
    return path.read_bytes()


def test_preference_cache_with_a_header_cut_inside_its_dict(tmp_path):
    """numpy's fallback parse of a header it cannot read as written re-tokenizes it, and a header cut
    inside its dict raised tokenize.TokenError there: one message instead."""
    from megacli.engine.array_files import load_cached

    header = b"{'descr': '<f8', 'fortran_order': False, 'shape': (4,".ljust(117) + b"\n"
    path = tmp_path / "train-0123456789abcdef.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
    with pytest.raises(UserError, match="not a .npy array file.*Delete it"):
        load_cached(path, shape=(4, 2), dtype=np.float64, what="reference log-probabilities")


@given(data=st.data())
def test_preference_cache(tmp_path, data):
    """The cached reference log-probabilities of 4 pairs: the array as saved, or one message; a
    pickled object array inside never runs."""
    import os

    from megacli.engine.array_files import load_cached

    path = tmp_path / "train-0123456789abcdef.npy"
    good = _good_cache(path)
    marker = tmp_path / "code-ran"
    hostile = path.with_suffix(".x.npy")
    np.save(hostile, np.array([_Payload(os.system, (f"touch {marker}",)), 1.0], dtype=object), allow_pickle=True)
    path.write_bytes(data.draw(st.one_of(inputs(good, max_size=256), inputs(hostile.read_bytes(), max_size=64))))
    found = outcome(load_cached, path, shape=(4, 2), dtype=np.float64, what="reference log-probabilities")
    if found is not None:
        assert found.shape == (4, 2) and found.dtype == np.float64 and np.isfinite(found).all()
    assert not marker.exists()


# ---------------------------------------------------------------- the Slurm script writer


def _slurm_recipe(fields: dict):
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    raw = base.apply_overrides({}, ["data.mock=true", "tokenizer.type=byte", "tokenizer.path=null"])
    raw["launch"] = {"slurm": {k: v for k, v in fields.items() if k != "run_dir"}}
    raw["run"] = {"dir": fields["run_dir"]}
    return base.validate(TrainingRecipe, raw, "fuzz")


_ODD_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from(
    list("\n\r\t\x00\x1b\x7f\u2028 '\"\\$`;|&#*-=")), max_size=24)


_WORD = st.text(st.characters(codec="utf-8", exclude_categories=["Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp"],
                               exclude_characters="'\"\\/") | st.sampled_from(list("$`;|&#*(){}")),
                min_size=1, max_size=12)  # what the script may hold: shell syntax stays text


@given(data=st.data())
def test_the_slurm_script_writer(tmp_path, data):
    """Whatever the fields hold (words with shell syntax; or, in one field, text with line breaks,
    spaces, quotes, NUL, escapes), the script is refused with a message or has the template's lines
    only: each #SBATCH line one option, the field's value intact in it, and `bash -n` passes."""
    import shutil
    import subprocess

    from megacli.slurm import batch_script

    drawn = {name: data.draw(_WORD, label=name) for name in ("job_name", "account", "option", "extra", "run_dir")}
    odd = data.draw(st.sampled_from([None, *drawn]), label="odd field")
    if odd:
        drawn[odd] = data.draw(_ODD_TEXT, label=odd)
    job_name, account, option, extra = drawn["job_name"], drawn["account"], "--" + drawn["option"], "--" + drawn["extra"]
    fields = {"job_name": job_name, "account": account, "sbatch_options": [option],
              "run_dir": str(tmp_path / (drawn["run_dir"] or "r"))}
    plain = {"job_name": "j", "account": "a", "sbatch_options": ["--o"], "run_dir": str(tmp_path / "r")}
    expected_lines = len(batch_script(_slurm_recipe(plain), job="pretrain", recipe_file=tmp_path / "r.yaml", gpus=0,
                                      extra=["--x"]).split("\n"))
    recipe = outcome(_slurm_recipe, fields)
    script = recipe and outcome(batch_script, recipe, job="pretrain", recipe_file=tmp_path / "r.yaml", gpus=0,
                                extra=[extra])
    if script is None:
        return
    lines = script.split("\n")  # bash's lines
    assert len(lines) == expected_lines
    sbatch = [line.split(" ", 1)[1] for line in lines if line.startswith("#SBATCH ")]
    assert all(len(option.split()) == 1 for option in sbatch), sbatch
    assert {f"--job-name={job_name}", f"--account={account}", option, extra} <= set(sbatch)
    checked = subprocess.run([shutil.which("bash"), "-n"], input=script, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
