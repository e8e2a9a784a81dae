"""`megacli serve` next to Hugging Face's own server on the same model and machine, in one run:
throughput, latency (p50, p99) and time to first token (p50, p99) per row, with the machine's
1-minute load average measured beside every row.

    python benchmarks/serve_bench.py --against transformers [--workdir DIR] [--hidden 256] [--layers 4] [--repeats 5] [--tiny]

Sides: `transformers serve --continuous-batching` (paged attention) on the Hugging Face directory,
`megacli serve` on the same model converted with `megacli convert`, once with its prefix cache
(the default) and once without. The model is generate_bench.py's random Llama-shaped one, fp32.
Clients are the official `openai` package's async client, streaming (for the time to first
token), greedy, stopping at no token but max_tokens (megacli: generate.stop_at_eod=false).

Rows: the issue's `clients x requests each, max_tokens` (1x8 32, 16x4 32, 64x2 32, 16x4 128), and a
shared-prefix workload: a system prompt of about --system-tokens tokens shared by 32 clients, each
with its own question. Each row runs every side back to back while all servers are up (an idle
server costs nothing), so the load average of one row is the same for all of its sides. A row runs
--repeats times, the sides' order reversed every other time, and each side's run of median
throughput is the one printed (its load average, latencies and TTFT); `ratio` is megacli (with its
prefix cache) over transformers, and on the shared-prefix row also over megacli without the cache.
`--tiny` runs a few requests on a tiny model (the test).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_bench import PROMPTS, build  # noqa: E402

from megacli.launch import free_port  # noqa: E402

ROWS = [(1, 8, 32), (16, 4, 32), (64, 2, 32), (16, 4, 128)]  # clients, requests per client, max_tokens
TINY_ROWS = [(2, 2, 8)]


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): {' '.join(map(str, proc.args))}")
        try:
            if httpx.get(url + "/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {url} did not start")


def start_server(workdir: Path, max_batch: int, extra: list[str] = (), log: Path | None = None,
                 wait: bool = True) -> tuple[subprocess.Popen, str]:
    """`megacli serve` on the converted model: (process, base URL), ready unless ``wait`` is False."""
    port = free_port()
    cmd = [sys.executable, "-m", "megacli", "serve", str(workdir / "mc"), "--port", str(port), "--max-batch",
           str(max_batch), "--max-queue", "1024", "--set", "generate.stop_at_eod=false",
           "--set", f"run.dir={workdir / f'run_{port}'}", *extra]
    out = open(log or os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    if wait:
        _wait_ready(proc, url)
    return proc, url


def _ready(side: tuple[subprocess.Popen, str], start, log: Path, tries: int = 3) -> tuple[subprocess.Popen, str]:
    """The started ``side`` once it answers; started again (``start(log)``, on a new free port) when
    another process took its port between free_port and the server binding it."""
    for attempt in range(tries):
        try:
            _wait_ready(*side)
            return side
        except SystemExit:
            if attempt == tries - 1 or "address already in use" not in log.read_text(errors="replace"):
                raise
            side = start(log)


def start_transformers(workdir: Path, max_batch: int, log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`transformers serve --continuous-batching` on the Hugging Face directory (not waited for)."""
    port = free_port()
    exe = shutil.which("transformers") or "transformers"
    cmd = [exe, "serve", str(workdir / "hf"), "--port", str(port), "--continuous-batching", "--dtype", "float32",
           "--cb-max-batch-tokens", str(max(256, max_batch * 8))]
    out = open(log or os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}/v1"


async def run_row(url: str, model: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """``clients`` concurrent streaming clients working through ``prompts``: throughput, latencies,
    times to first token, texts."""
    import openai

    texts: list[str | None] = [None] * len(prompts)
    latencies, firsts, tokens = [], [], 0
    todo = iter(range(len(prompts)))
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600) as client:
        async def worker():
            nonlocal tokens
            for i in todo:
                start, first, parts, usage = time.perf_counter(), None, [], None
                stream = await client.completions.create(model=model, prompt=prompts[i], max_tokens=max_tokens,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        first = first or time.perf_counter()
                        parts.append(chunk.choices[0].text)
                    usage = chunk.usage or usage
                latencies.append(time.perf_counter() - start)
                firsts.append((first or time.perf_counter()) - start)
                texts[i] = "".join(parts)
                tokens += usage.completion_tokens if usage else len(parts)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    return {"tokens_per_second": tokens / wall, "tokens": tokens, "latency": _p50_p99(latencies),
            "ttft": _p50_p99(firsts), "texts": texts}


def _p50_p99(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return statistics.median(values), values[min(len(values) - 1, int(0.99 * len(values)))]


def shared_prefix_prompts(workdir: Path, system_tokens: int, clients: int) -> list[str]:
    """A system prompt of about ``system_tokens`` tokens, then one question per client."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(workdir / "hf")
    words, system = " ".join(PROMPTS).split(), ""
    i = 0
    while len(tok.encode(system)) < system_tokens:
        system += words[i % len(words)] + " "
        i += 1
    return [f"{system}\nquestion {k}: {PROMPTS[k % len(PROMPTS)]}" for k in range(clients)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", choices=["transformers", "none"], default="transformers")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=960, help="shared-prefix row: the system prompt's length")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each row per side (the median is printed)")
    ap.add_argument("--tiny", action="store_true", help="a few requests on a tiny model (the test)")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="megacli-serve-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    hidden, layers = (64, 2) if args.tiny else (args.hidden, args.layers)
    repeats = args.repeats
    if not (workdir / "mc").exists():
        build(workdir, hidden, layers)
    rows = TINY_ROWS if args.tiny else ROWS
    shared_clients, system_tokens = (4, 48) if args.tiny else (32, args.system_tokens)
    max_batch = max(c for c, _, _ in rows + [(shared_clients, 0, 0)])
    starts = {"megacli": (lambda log: start_server(workdir, max_batch, log=log, wait=False), workdir / "megacli.log"),
              "megacli, no prefix cache": (lambda log: start_server(workdir, max_batch, ["--no-prefix-cache"], log=log,
                                                                    wait=False), workdir / "nocache.log")}
    if args.against == "transformers":
        starts["transformers"] = (lambda log: start_transformers(workdir, max_batch, log=log), workdir / "transformers.log")
    sides = {name: start(log) for name, (start, log) in starts.items()}  # started together, ready one after the other
    try:
        for name, (start, log) in starts.items():
            sides[name] = _ready(sides[name], start, log)
        print(f"model: random Llama, hidden {hidden}, {layers} layers, fp32; greedy, streamed; {os.cpu_count()} cores "
              f"shared (torch threads: transformers all, megacli all but one); sides run back to back per row, "
              f"median of {repeats}", flush=True)
        print("| row | side | load avg (1 min) | tokens/s | ratio | p50 / p99 latency | p50 / p99 TTFT |")
        print("|---|---|---|---|---|---|---|")
        for clients, each, max_tokens in rows:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(clients * each)]
            _row(sides, f"{clients} x {each}, {max_tokens}", prompts, clients, max_tokens, with_cache_baseline=False,
                 repeats=repeats)
        prompts = shared_prefix_prompts(workdir, system_tokens, shared_clients)
        new = 8 if args.tiny else 32
        _row(sides, f"shared prefix ~{system_tokens} tokens, {shared_clients} x 1, {new}", prompts, shared_clients, new,
             with_cache_baseline=True, repeats=repeats)
    finally:
        for proc, _ in sides.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in sides.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _row(sides: dict, name: str, prompts: list[str], clients: int, max_tokens: int, *, with_cache_baseline: bool,
         repeats: int) -> None:
    runs = {}
    order = [s for s in ("transformers", "megacli, no prefix cache", "megacli") if s in sides]
    if not with_cache_baseline:
        order = [s for s in order if s != "megacli, no prefix cache"]
    for side in order:
        proc, url = sides[side]
        model = "mc" if side.startswith("megacli") else _hf_model_name(url)
        asyncio.run(run_row(url, model, prompts[: min(len(prompts), clients)], clients, 2))  # warm-up
    for r in range(repeats):
        for side in order if r % 2 == 0 else order[::-1]:
            proc, url = sides[side]
            model = "mc" if side.startswith("megacli") else _hf_model_name(url)
            load = os.getloadavg()[0]
            runs.setdefault(side, []).append((load, asyncio.run(run_row(url, model, prompts, clients, max_tokens))))
    results = {side: sorted(rs, key=lambda x: x[1]["tokens_per_second"])[len(rs) // 2] for side, rs in runs.items()}
    mine = results["megacli"][1]["tokens_per_second"]
    for side in order:
        load, r = results[side]
        ratio = "" if side != "megacli" else " / ".join(
            f"{mine / results[o][1]['tokens_per_second']:.2f}x vs {o}" for o in order if o != "megacli")
        print(f"| {name} | {side} | {load:.2f} | {r['tokens_per_second']:.1f} | {ratio} | "
              f"{r['latency'][0]:.3f} / {r['latency'][1]:.3f} s | {r['ttft'][0]:.3f} / {r['ttft'][1]:.3f} s |", flush=True)
    if "megacli, no prefix cache" in results:
        assert all(r["texts"] == results["megacli, no prefix cache"][1]["texts"] for _, r in runs["megacli"]), \
            "the prefix cache changed a greedy text"


def _hf_model_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/models", timeout=30).json()["data"][0]["id"]


if __name__ == "__main__":
    main()
