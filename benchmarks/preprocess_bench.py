#!/usr/bin/env python
"""megacli preprocess vs gigatoken's own encode_files vs megacli's previous path vs Megatron-LM's
tools/preprocess_data.py: throughput and byte identity, in one run.

Every tool tokenizes the same JSONL corpus (built by data_tools/build_corpus.py, >= 50 MB by
default, repeated when the build gives less) with the same Hugging Face byte-level BPE
(data_tools/train_tokenizer.py, 4096 ids) and --append-eod, and writes a .bin/.idx pair:

  megacli            megacli preprocess (gigatoken path), --workers as given
  gigatoken          gigatoken's Tokenizer.encode_files(JsonlFileSource) on all cores, then
                     numpy appends the eod tokens and writes .bin and .idx (no megacli code)
  megacli-previous   megacli preprocess with MEGACLI_NO_GIGATOKEN=1 (the tokenizers library)
  Megatron-LM        tools/preprocess_data.py of a core_v0.16.1 checkout (with --megatron)

Each run is a fresh process timed end to end (what a user waits for: start-up, reading,
tokenizing, writing); the tools take turns, and the median of --runs is reported with MB/s and
ratios. Then every output is compared byte for byte with megacli's.

    python benchmarks/preprocess_bench.py [--runs 3] [--workers 2] [--min-mb 50] \\
        [--megatron /path/to/Megatron-LM-core_v0.16.1 [--megatron-pythonpath DIR]] [--skip-previous]

--megatron is a checkout of Megatron-LM core_v0.16.1 (e.g. `git archive core_v0.16.1`); it runs
with that checkout on PYTHONPATH. Its tool imports megatron.training, which imports triton; on a
CPU-only machine install triton aside (pip install --no-deps --target /tmp/triton triton) and
pass --megatron-pythonpath /tmp/triton.
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
        built = corpus.read_bytes()
        if built and len(built) < args.min_mb * MB:  # repeat what the sources gave
            with open(corpus, "ab") as f:
                for _ in range(int(args.min_mb * MB // len(built))):
                    f.write(built)
    tokenizer = Path(args.tokenizer)
    if not (tokenizer / "tokenizer.json").is_file():
        print(f"training {tokenizer} ...", flush=True)
        sh([sys.executable, "data_tools/train_tokenizer.py", "--input", str(corpus), "--output", str(tokenizer),
            "--vocab-size", "4096"])
    return corpus, tokenizer


# gigatoken alone: encode_files reads and tokenizes in Rust on all cores; numpy does the rest.
GIGATOKEN_ALONE = r"""
import struct, sys
import awkward as ak, gigatoken, numpy as np
corpus, tokenizer_json, prefix, eod = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
docs = gigatoken.Tokenizer.from_json(open(tokenizer_json, "rb").read()).encode_files(
    gigatoken.JsonlFileSource([corpus], field="text"))
counts = ak.to_numpy(ak.num(docs))
lengths = (counts + 1)[counts > 0]
tokens = np.full(int(lengths.sum()), eod, np.uint16)
tokens[np.arange(int(counts.sum())) + np.repeat(np.arange(len(lengths)), counts[counts > 0])] = ak.to_numpy(ak.flatten(docs))
tokens.tofile(prefix + ".bin")
doc_index = np.concatenate([[0], np.cumsum(counts > 0)]).astype(np.int64)
with open(prefix + ".idx", "wb") as f:
    f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(lengths), len(doc_index)))
    f.write(lengths.astype(np.int32).tobytes())
    f.write(((np.cumsum(lengths) - lengths) * 2).astype(np.int64).tobytes())
    f.write(doc_index.tobytes())
"""


def run_megacli(corpus: Path, tokenizer: Path, prefix: Path, workers: int, previous: bool) -> float:
    env = dict(os.environ, MEGACLI_NO_GIGATOKEN="1" if previous else "")
    seconds, log = sh([sys.executable, "-m", "megacli", "preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
                       "--tokenizer", str(tokenizer), "--append-eod", "--workers", str(workers), "--no-progress"], env=env)
    used_gigatoken = "gigatoken" in log.split("encoder", 1)[-1].split("\n", 1)[0]
    if used_gigatoken == previous:
        sys.exit(f"megacli {'used' if used_gigatoken else 'did not use'} gigatoken here:\n{log}")
    return seconds


def run_gigatoken(corpus: Path, tokenizer: Path, prefix: Path) -> float:
    import json

    eod = json.loads((tokenizer / "tokenizer_config.json").read_text())["eos_token"]
    eod_id = json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"][eod]
    seconds, _ = sh([sys.executable, "-c", GIGATOKEN_ALONE, str(corpus), str(tokenizer / "tokenizer.json"), str(prefix), str(eod_id)])
    return seconds


def run_megatron(checkout: Path, extra_path: list[str], corpus: Path, tokenizer: Path, prefix: Path, workers: int) -> float:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), *extra_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    seconds, log = sh([sys.executable, str(checkout / "tools/preprocess_data.py"), "--input", str(corpus),
                       "--output-prefix", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer",
                       "--tokenizer-model", str(tokenizer), "--append-eod", "--workers", str(workers),
                       "--log-interval", "1000"], env=env)
    rates = re.findall(r"Processed \d+ documents \([\d.]+ docs/s, ([\d.]+) MB/s\)", log)
    if rates:
        print(f"      (Megatron-LM's own log: {float(rates[-1]):.2f} MB/s steady state)", flush=True)
    return seconds


def identical(a: str, b: str) -> bool:
    return all(filecmp.cmp(f"{a}.{ext}", f"{b}.{ext}", shallow=False) for ext in ("bin", "idx"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron", help="Path of a Megatron-LM core_v0.16.1 checkout.")
    parser.add_argument("--megatron-pythonpath", action="append", default=[], help="Extra PYTHONPATH entry for the Megatron-LM run (e.g. a triton install).")
    parser.add_argument("--corpus", default="data/bench/corpus.jsonl", help="Benchmark corpus (built when missing).")
    parser.add_argument("--tokenizer", default="data/bench/tokenizer", help="HF tokenizer directory (trained when missing).")
    parser.add_argument("--min-mb", type=float, default=50, help="Size of the corpus to build (default 50).")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="Worker processes for megacli and Megatron-LM (default: cores).")
    parser.add_argument("--runs", type=int, default=3, help="Runs per tool; the median is reported (default 3).")
    parser.add_argument("--skip-previous", action="store_true", help="Leave out megacli's previous path (the slowest).")
    parser.add_argument("--out", default="data/bench/out", help="Where the outputs go.")
    args = parser.parse_args(argv)

    corpus, tokenizer = prepare(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size_mb = corpus.stat().st_size / MB
    tools = {
        "megacli": lambda p: run_megacli(corpus, tokenizer, p, args.workers, previous=False),
        "gigatoken encode_files": lambda p: run_gigatoken(corpus, tokenizer, p),
    }
    if not args.skip_previous:
        tools["megacli previous"] = lambda p: run_megacli(corpus, tokenizer, p, args.workers, previous=True)
    if args.megatron:
        tools["Megatron-LM"] = lambda p: run_megatron(Path(args.megatron), args.megatron_pythonpath, corpus, tokenizer, p, args.workers)
    prefixes = {name: out / re.sub(r"\W+", "_", name) for name in tools}
    print(f"corpus {corpus}: {size_mb:.1f} MB; tokenizer {tokenizer}; {args.workers} worker(s); "
          f"{os.cpu_count()} core(s); {args.runs} run(s) each", flush=True)

    seconds: dict[str, list[float]] = {name: [] for name in tools}
    for i in range(args.runs):
        for name, tool in tools.items():
            seconds[name].append(tool(prefixes[name]))
            print(f"  run {i + 1}: {name:24s} {seconds[name][-1]:7.1f} s  {size_mb / seconds[name][-1]:7.2f} MB/s", flush=True)

    median = {name: statistics.median(s) for name, s in seconds.items()}
    base = median["gigatoken encode_files"]
    print(f"\n{'':24s} {'median s':>9s} {'MB/s':>8s} {'vs gigatoken':>13s}  byte-identical to megacli")
    reference = str(prefixes["megacli"]) + "_text_document"
    all_same = True
    for name in tools:
        written = str(prefixes[name]) + ("" if name == "gigatoken encode_files" else "_text_document")
        same = name == "megacli" or identical(written, reference)
        all_same = all_same and same
        print(f"{name:24s} {median[name]:9.2f} {size_mb / median[name]:8.2f} {base / median[name]:12.2f}x  "
              f"{'-' if name == 'megacli' else 'yes' if same else 'NO'}")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
