#!/usr/bin/env python
"""Muon against AdamW on the local corpus (README's: the docstrings installed here, no network):
the loss curves of a tiny GPT trained by `megacli pretrain` with each optimizer at the best
learning rate of a small sweep, side by side, and the step at which each first reaches a loss.

Needs Megatron-Core 0.19 (Python 3.12) for optim.optimizer: muon. The corpus (2 MB of docstrings),
its BPE tokenizer (1,024 ids) and the indexed dataset are built in --workdir on the first run.
Every run is the same recipe (4 layers, hidden 64, SwiGLU, RoPE, RMSNorm; 16 sequences of 64
tokens a step; warmup 10%, cosine decay to lr/10, weight decay 0.1; fp32; one process; the same
seed, so the same weights and batches), only the optimizer and lr differ. The best lr of each sweep
is the one with the lowest validation loss at the end; the curves are the training loss averaged
over the --every steps up to each row's step.

    python benchmarks/muon_curves.py [--iters 150] [--every 10] [--adam-lrs 1e-3,3e-3,1e-2] \\
        [--muon-lrs 1e-2,3e-2,1e-1] [--target LOSS] [--workdir /tmp/megacli_muon_curves]

--target defaults to AdamW's final averaged training loss: how many steps Muon needs to match it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=176",
         "model.seq_length=64", "parallel.tensor=1", "parallel.pipeline=1", "launch.nproc=1",
         "train.micro_batch_size=8", "train.global_batch_size=16", "train.precision=fp32", "train.log_interval=1",
         "train.eval_iters=8", "train.plot=false", "checkpoint.dir=null", "optim.warmup_fraction=0.1",
         "optim.decay_style=cosine", "optim.weight_decay=0.1"]


def sh(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"command failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout + out.stderr


def prepare(work: Path) -> Path:
    """The indexed dataset's prefix (corpus, tokenizer and dataset built once)."""
    prefix = work / "corpus_text_document"
    if not prefix.with_suffix(".idx").is_file():
        work.mkdir(parents=True, exist_ok=True)
        sh([sys.executable, "data_tools/build_corpus.py", "--output", str(work / "corpus.jsonl"), "--max-mb", "2"])
        sh([sys.executable, "data_tools/train_tokenizer.py", "--input", str(work / "corpus.jsonl"),
            "--output", str(work / "tokenizer"), "--vocab-size", "1024"])
        sh([sys.executable, "-m", "megacli", "preprocess", "--input", str(work / "corpus.jsonl"),
            "--output-prefix", str(work / "corpus"), "--tokenizer", str(work / "tokenizer"), "--append-eod"])
    return prefix


def train(work: Path, prefix: Path, optimizer: str, lr: float, iters: int) -> dict:
    """One run: its training loss by step and its final validation loss."""
    run = work / "runs" / f"{optimizer}_{lr:g}"
    sets = [*MODEL, f"tokenizer.path={work / 'tokenizer'}", f"data.path={prefix}", f"train.iters={iters}",
            f"train.eval_interval={iters}", f"optim.optimizer={optimizer}", f"optim.lr={lr}", f"optim.min_lr={lr / 10}",
            f"run.dir={run}"]
    shutil.rmtree(run, ignore_errors=True)
    sh([sys.executable, "-m", "megacli", "pretrain", "recipes/gpt_tiny.yaml", *[x for s in sets for x in ("--set", s)]])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"loss": {r["iteration"]: r["loss"] for r in records if "loss" in r},
            "val": [r["val_loss"] for r in records if "val_loss" in r][-1]}


def averaged(loss: dict[int, float], every: int) -> dict[int, float]:
    """The training loss averaged over the ``every`` steps up to each multiple of ``every``."""
    return {s: sum(loss[i] for i in range(s - every + 1, s + 1)) / every for s in range(every, max(loss) + 1, every)}


def first_reaching(curve: dict[int, float], target: float) -> str:
    return next((str(s) for s, v in curve.items() if v <= target), "-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=150)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--adam-lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--muon-lrs", default="1e-2,3e-2,1e-1")
    ap.add_argument("--target", type=float, default=None)
    ap.add_argument("--workdir", default="/tmp/megacli_muon_curves")
    args = ap.parse_args()
    start = time.perf_counter()
    work = Path(args.workdir)
    prefix = prepare(work)
    sweeps = {opt: {float(lr): train(work, prefix, opt, float(lr), args.iters) for lr in lrs.split(",")}
              for opt, lrs in (("adam", args.adam_lrs), ("muon", args.muon_lrs))}
    names = {"adam": "AdamW", "muon": "Muon"}

    print(f"validation loss after {args.iters} steps:")
    print(f"{'optimizer':<10} {'lr':>8} {'val loss':>9}")
    for opt, runs in sweeps.items():
        for lr, r in runs.items():
            print(f"{names[opt]:<10} {lr:>8g} {r['val']:>9.4f}")
    best = {opt: min(runs, key=lambda lr: runs[lr]["val"]) for opt, runs in sweeps.items()}
    curves = {opt: averaged(sweeps[opt][best[opt]]["loss"], args.every) for opt in sweeps}
    heads = [f"{names[opt]} lr {best[opt]:g}" for opt in sweeps]
    print(f"\ntraining loss, mean of the {args.every} steps up to each step (best lr of each sweep):")
    print(f"{'step':>5} " + " ".join(f"{h:>16}" for h in heads))
    for s in curves["adam"]:
        print(f"{s:>5} " + " ".join(f"{curves[opt][s]:>16.4f}" for opt in sweeps))
    target = args.target if args.target is not None else curves["adam"][max(curves["adam"])]
    print(f"\nfirst step whose {args.every}-step mean is <= {target:.4f}: "
          + ", ".join(f"{names[opt]} {first_reaching(curves[opt], target)}" for opt in sweeps))
    print("final validation loss: " + ", ".join(f"{names[opt]} {sweeps[opt][best[opt]]['val']:.4f}" for opt in sweeps))
    print(f"({len(sweeps['adam']) + len(sweeps['muon'])} runs in {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
