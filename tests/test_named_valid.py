"""Named validation sets (data.valid): each gives val_loss/<name> and val_ppl/<name> at every
evaluation, equal to a standalone scoring of the same tokens with the saved checkpoint; bad names
and prefixes are refused before training."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from megacli.data import indexed
from tests.conftest import pretrain

SEQ = 32
TINY = [
    "data.mock=false", "tokenizer.type=byte", "tokenizer.path=null", "data.split=9,1,0",
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
    f"model.seq_length={SEQ}", "train.iters=4", "train.micro_batch_size=2", "train.global_batch_size=4",
    "train.eval_interval=2", "train.eval_iters=3", "train.log_interval=1", "optim.warmup_iters=0", "optim.lr=1e-2",
    "train.precision=fp32", "parallel.tensor=1", "parallel.pipeline=1", "parallel.sequence_parallel=false",
    "launch.nproc=1", "checkpoint.dir=null",
]


def corpus(prefix: Path, docs: list[int], seed: int) -> list[int]:
    """Random documents of the given lengths; returns their tokens laid end to end."""
    rng = np.random.default_rng(seed)
    stream = []
    with indexed.IndexedDatasetWriter(prefix, np.uint16) as w:
        for n in docs:
            doc = rng.integers(0, 250, n).tolist()
            w.add_document(doc)
            stream += doc
        w.commit()
    return stream


def run(tmp: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """`megacli pretrain` of TINY with the overrides into TMP/run, finished however it finished."""
    return pretrain(tmp / "run", [*TINY, *overrides], check=False, timeout=300)


def _score(rank, world, ckpt: str, windows: dict) -> dict:
    """Mean next-token loss of each set's windows (SEQ + 1 tokens each) under the checkpoint."""
    import torch

    from megacli.engine import distributed
    from megacli.inference.generator import build_generator
    from megacli.recipe import base
    from megacli.recipe.generate import GenerateRecipe

    raw = base.read_yaml(Path(ckpt) / "iter_0000004" / "recipe.yaml")
    recipe = base.validate(GenerateRecipe, {**raw, "generate": {"checkpoint": ckpt}}, "test")
    runtime = distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=0)
    try:
        model = build_generator(recipe, runtime).model
        out = {}
        for name, rows in windows.items():
            total = 0.0
            for row in rows:
                ids = torch.tensor([row])
                logits = model.forward(ids[:, :-1], torch.arange(SEQ)[None], None, None, all_positions=True)[0]
                total += float(torch.nn.functional.cross_entropy(logits.double(), ids[0, 1:], reduction="sum"))
            out[name] = total / (len(rows) * SEQ)
        return out
    finally:
        distributed.teardown()


def test_named_sets_equal_standalone_scoring(tmp_path):
    corpus(tmp_path / "train", [100] * 40, seed=0)
    # alpha: 10 samples, fewer than eval_iters × global batch = 12: all scored (the last batch padded);
    # beta: 18 samples, the first 12 scored. Both in file order, across document boundaries.
    streams = {"alpha": corpus(tmp_path / "alpha", [70, 130, 150], seed=1),
               "beta": corpus(tmp_path / "beta", [200, 200, 200], seed=2)}
    ck = tmp_path / "ck"
    out = run(tmp_path, [f"data.path={tmp_path / 'train'}", f"data.valid.alpha={tmp_path / 'alpha'}",
                              f"data.valid.beta={tmp_path / 'beta'}", f"checkpoint.dir={ck}"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "validation set alpha: 10 samples" in out.stdout and "scores 10 of them" in out.stdout, out.stdout
    assert "validation set beta: 18 samples" in out.stdout and "scores 12 of them" in out.stdout, out.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["iteration"]: r for r in records if "val_loss/alpha" in r}
    assert sorted(evals) == [2, 4]
    final = evals[4]
    assert "val_loss" in final and "val_ppl" in final, "the split-based validation loss stays"
    assert final["val_loss/alpha"] != final["val_loss/beta"]
    scored = {"alpha": 10, "beta": 12}
    windows = {name: [stream[k * SEQ : k * SEQ + SEQ + 1] for k in range(scored[name])]
               for name, stream in streams.items()}
    from tests._dist import spawn

    [standalone] = spawn(_score, 1, str(ck), windows)
    for name in windows:
        assert abs(final[f"val_loss/{name}"] - standalone[name]) <= 1e-5, (name, final, standalone)
        assert final[f"val_ppl/{name}"] == pytest.approx(math.exp(final[f"val_loss/{name}"]), rel=1e-12)
        assert f"{name}: loss {final[f'val_loss/{name}']:.4f}" in out.stdout


@pytest.mark.parametrize("case", ["missing prefix", "bad name", "too short"])
def test_bad_named_set_is_refused(tmp_path, case):
    corpus(tmp_path / "train", [100] * 40, seed=0)
    corpus(tmp_path / "short", [20], seed=3)
    valid, expected = {
        "missing prefix": (f"data.valid.web={tmp_path / 'nothing'}", ["data.valid.web", "nothing.bin"]),
        "bad name": (f"data.valid={{'web-2': {tmp_path / 'train'}}}", ["data.valid", "'web-2'", "not an identifier"]),
        "too short": (f"data.valid.web={tmp_path / 'short'}", ["data.valid.web", "holds 20 tokens", "33"]),
    }[case]
    out = run(tmp_path, [f"data.path={tmp_path / 'train'}", valid])
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    for text in expected:
        assert text in out.stderr, out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_sft_named_set_equals_the_same_file_as_the_validation_split(tmp_path):
    """sft.valid as a map: val_loss/<name> of a file is the val_loss that file gives as sft.valid."""
    rng = np.random.default_rng(4)

    def records(path: Path, n: int) -> str:
        words = ["alpha", "beta", "gamma", "delta", "epsilon"]
        with path.open("w") as f:
            for _ in range(n):
                f.write(json.dumps({"prompt": " ".join(rng.choice(words, 3)), "response": " ".join(rng.choice(words, 4))})
                        + "\n")
        return str(path)

    train, held = records(tmp_path / "train.jsonl", 24), records(tmp_path / "held.jsonl", 14)
    common = ["data.path=null", f"sft.train={train}", "sft.valid_fraction=0", "sft.packing=false", "sft.template=plain"]
    losses = {}
    for name, valid in (("file", f"sft.valid={held}"), ("named", f"sft.valid.held={held}")):
        out = run(tmp_path / name, [*common, valid])
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        records_ = [json.loads(line) for line in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
        losses[name] = {r["iteration"]: r for r in records_ if any(k.startswith("val_loss") for k in r)}
    assert sorted(losses["named"]) == [2, 4] and "val_loss" not in losses["named"][4], "no split, no val_loss"
    for it in (2, 4):
        assert losses["named"][it]["val_loss/held"] == losses["file"][it]["val_loss"]
