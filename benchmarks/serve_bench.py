"""`megacli serve` under concurrent clients on CPU: generated tokens per second and per-request
latency (p50, p99) at 1, 4, 16 and 32 concurrent clients, next to the same requests sent one at a
time, and next to Hugging Face `generate` (one prompt at a time, its own KV cache) on the same
model, all in one run.

    python benchmarks/serve_bench.py [--workdir DIR] [--hidden 256] [--layers 4] [--new 32] [--requests 32]

The model is generate_bench.py's random Llama-shaped one (converted with `megacli convert`). The
server is the real command (`megacli serve`, a subprocess on a free loopback port, stopping at no
token but max_tokens, greedy); clients are the official `openai` package's async client. Each
concurrency level sends the same --requests requests (the prompts of generate_bench.py in turn),
each client taking the next unsent one. Hugging Face runs in a process of its own, without
megacli's CPU backend. Every side's texts are checked to be equal to the one-at-a-time ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_bench import PROMPTS, build  # noqa: E402

LEVELS = (1, 4, 16, 32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(workdir: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "megacli", "serve", str(workdir / "mc"), "--port", str(port), "--max-batch",
           str(max_batch), "--max-queue", "256", "--set", "generate.stop_at_eod=false", "--set", f"run.dir={workdir / 'run'}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("serving "):
            return proc, f"http://127.0.0.1:{port}/v1"
    raise SystemExit("the server did not start")


async def run_level(url: str, bodies: list[dict], clients: int) -> dict:
    """``clients`` concurrent clients working through ``bodies``: wall seconds, tokens, latencies, texts."""
    import openai

    texts: list[str | None] = [None] * len(bodies)
    latencies: list[float] = []
    tokens = 0
    todo = iter(range(len(bodies)))

    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as client:
        async def worker():
            nonlocal tokens
            for i in todo:
                start = time.perf_counter()
                res = await client.completions.create(**bodies[i])
                latencies.append(time.perf_counter() - start)
                texts[i], tokens = res.choices[0].text, tokens + res.usage.completion_tokens

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    latencies.sort()
    return {"clients": clients, "seconds": wall, "tokens": tokens, "tokens_per_second": tokens / wall,
            "p50": statistics.median(latencies), "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "texts": texts}


def hf_side(workdir: Path, new: int, n: int) -> None:
    """One prompt at a time through Hugging Face generate (greedy, no stop token): tokens/s and latencies."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(workdir / "hf", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(workdir / "hf")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]

    def one(p):
        ids = tok(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.eos_token_id)
        return tok.decode(out[0, ids.shape[1]:])

    one(prompts[0])  # warm-up
    latencies, texts = [], []
    start = time.perf_counter()
    for p in prompts:
        t0 = time.perf_counter()
        texts.append(one(p))
        latencies.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    latencies.sort()
    result = {"clients": 1, "seconds": wall, "tokens": n * new, "tokens_per_second": n * new / wall,
              "p50": statistics.median(latencies), "p99": latencies[min(n - 1, int(0.99 * n))], "texts": texts,
              "threads": torch.get_num_threads()}
    (workdir / "result_hf.json").write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new", type=int, default=32, help="max_tokens per request")
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--hf-side", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="megacli-serve-bench-"))
    if args.hf_side:
        return hf_side(workdir, args.new, args.requests)
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "mc").exists():
        build(workdir, args.hidden, args.layers)
    bodies = [{"model": "mc", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.new, "temperature": 0}
              for i in range(args.requests)]
    proc, url = start_server(workdir, max_batch=max(LEVELS))
    try:
        asyncio.run(run_level(url, bodies[:4], 4))  # warm-up
        rows = [asyncio.run(run_level(url, bodies, c)) for c in LEVELS]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    subprocess.run([sys.executable, __file__, "--hf-side", "--workdir", str(workdir), "--new", str(args.new),
                    "--requests", str(args.requests)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ})
    hf = json.loads((workdir / "result_hf.json").read_text())
    alone = rows[0]
    for row in rows:
        assert row["texts"] == alone["texts"], f"{row['clients']} clients: texts differ from one at a time"
    same_as_hf = sum(a == b for a, b in zip(alone["texts"], hf["texts"]))
    print(f"{args.requests} requests x {args.new} tokens, greedy; hidden {args.hidden}, {args.layers} layers; "
          f"HF threads {hf['threads']}; texts equal to HF generate: {same_as_hf}/{args.requests}")
    print("| side | clients | tokens/s | vs one at a time | p50 latency | p99 latency |")
    print("|---|---|---|---|---|---|")
    for label, row in [("HF generate, one at a time", hf)] + [("megacli serve", r) for r in rows]:
        print(f"| {label} | {row['clients']} | {row['tokens_per_second']:.1f} | "
              f"{row['tokens_per_second'] / alone['tokens_per_second']:.2f}x | {row['p50']:.3f} s | {row['p99']:.3f} s |")


if __name__ == "__main__":
    main()
