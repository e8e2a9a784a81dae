#!/usr/bin/env python
"""megacli preprocess vs Megatron-LM's tools/preprocess_data.py: throughput and byte identity.

Both tools tokenize the same corpus (built by data_tools/build_corpus.py, >= 50 MB by default)
with the same Hugging Face byte-level BPE (data_tools/train_tokenizer.py, 4096 ids) and
--append-eod, at the same worker count; each run is a fresh process, timed end to end (what a
user waits for), alternating the tools; the median of --runs is reported, with Megatron-LM's own
steady-state MB/s log line beside it. Then the .bin/.idx pairs are compared byte for byte.

    python benchmarks/preprocess_bench.py --megatron /path/to/Megatron-LM-core_v0.16.1 \\
        [--megatron-pythonpath DIR] [--workers 2] [--runs 3] [--min-mb 50]

--megatron is a checkout of Megatron-LM core_v0.16.1 (e.g. `git archive core_v0.16.1`); it runs
with that checkout on PYTHONPATH. Its tool imports megatron.training, which imports triton; on a
CPU-only machine install triton aside (pip install --no-deps --target /tmp/triton triton) and
pass --megatron-pythonpath /tmp/triton. Without --megatron only megacli is measured.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MB = 1024 * 1024


def sh(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        sys.exit(f"command failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return seconds, out.stdout + out.stderr


def prepare(args) -> tuple[Path, Path]:
    corpus = Path(args.corpus)
    if not corpus.is_file():
        print(f"building {corpus} (>= {args.min_mb} MB) ...", flush=True)
        sh([sys.executable, "data_tools/build_corpus.py", "--output", str(corpus), "--min-mb", str(args.min_mb), "--max-mb", "0"])
    tokenizer = Path(args.tokenizer)
    if not (tokenizer / "tokenizer.json").is_file():
        print(f"training {tokenizer} ...", flush=True)
        sh([sys.executable, "data_tools/train_tokenizer.py", "--input", str(corpus), "--output", str(tokenizer),
            "--vocab-size", "4096"])
    return corpus, tokenizer


def run_megacli(corpus: Path, tokenizer: Path, prefix: Path, workers: int) -> float:
    seconds, _ = sh([sys.executable, "-m", "megacli", "preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
                     "--tokenizer", str(tokenizer), "--append-eod", "--workers", str(workers), "--no-progress"])
    return seconds


def run_megatron(checkout: Path, extra_path: list[str], corpus: Path, tokenizer: Path, prefix: Path, workers: int) -> tuple[float, float | None]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), *extra_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    seconds, log = sh([sys.executable, str(checkout / "tools/preprocess_data.py"), "--input", str(corpus),
                       "--output-prefix", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer",
                       "--tokenizer-model", str(tokenizer), "--append-eod", "--workers", str(workers),
                       "--log-interval", "1000"], env=env)
    rates = re.findall(r"Processed \d+ documents \([\d.]+ docs/s, ([\d.]+) MB/s\)", log)
    return seconds, float(rates[-1]) if rates else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron", help="Path of a Megatron-LM core_v0.16.1 checkout.")
    parser.add_argument("--megatron-pythonpath", action="append", default=[], help="Extra PYTHONPATH entry for the Megatron-LM run (e.g. a triton install).")
    parser.add_argument("--corpus", default="data/bench/corpus.jsonl", help="Benchmark corpus (built when missing).")
    parser.add_argument("--tokenizer", default="data/bench/tokenizer", help="HF tokenizer directory (trained when missing).")
    parser.add_argument("--min-mb", type=float, default=50, help="Size of the corpus to build (default 50).")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="Worker processes for both tools (default: cores).")
    parser.add_argument("--runs", type=int, default=3, help="Runs per tool; the median is reported (default 3).")
    parser.add_argument("--out", default="data/bench/out", help="Where the outputs go.")
    args = parser.parse_args(argv)

    corpus, tokenizer = prepare(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size_mb = corpus.stat().st_size / MB
    print(f"corpus {corpus}: {size_mb:.1f} MB; tokenizer {tokenizer}; {args.workers} worker(s); {args.runs} run(s) each", flush=True)

    ours, theirs, their_rates = [], [], []
    for i in range(args.runs):
        ours.append(run_megacli(corpus, tokenizer, out / "megacli", args.workers))
        print(f"  run {i + 1}: megacli      {ours[-1]:6.1f} s  {size_mb / ours[-1]:6.2f} MB/s", flush=True)
        if args.megatron:
            seconds, rate = run_megatron(Path(args.megatron), args.megatron_pythonpath, corpus, tokenizer, out / "megatron", args.workers)
            theirs.append(seconds)
            if rate is not None:
                their_rates.append(rate)
            print(f"  run {i + 1}: Megatron-LM  {seconds:6.1f} s  {size_mb / seconds:6.2f} MB/s"
                  + (f"  (its log: {rate:.2f} MB/s)" if rate is not None else ""), flush=True)

    ours_s = statistics.median(ours)
    print(f"\nmegacli preprocess:        {size_mb / ours_s:6.2f} MB/s  (median {ours_s:.1f} s)")
    if not theirs:
        return 0
    theirs_s = statistics.median(theirs)
    print(f"Megatron-LM preprocess_data: {size_mb / theirs_s:6.2f} MB/s  (median {theirs_s:.1f} s"
          + (f"; steady state per its log {statistics.median(their_rates):.2f} MB/s" if their_rates else "") + ")")
    print(f"speed-up: {theirs_s / ours_s:.2f}x end to end"
          + (f", {size_mb / ours_s / statistics.median(their_rates):.2f}x against its steady-state rate" if their_rates else ""))
    identical = all(filecmp.cmp(f"{out}/megacli_text_document.{ext}", f"{out}/megatron_text_document.{ext}", shallow=False)
                    for ext in ("bin", "idx"))
    print(f"byte-identical .bin and .idx: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
