"""Where `megacli serve`'s time goes while it decodes: py-spy samples the real server (every thread,
its worker processes included) while 1 and then 16 clients send greedy requests, and the entries
with the most samples are printed, by own time and by time inclusive of callees.

    python benchmarks/serve_profile.py [--workdir DIR] [--seconds 15] [--top 15] [--set KEY=VALUE ...]

The model and requests are serve_bench.py's (a random 256-wide, 4-layer Llama, 32-token answers).
Needs py-spy (`pip install py-spy`) and permission to attach to a child process.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_bench import PROMPTS, build  # noqa: E402
from serve_bench import run_row, start_server  # noqa: E402


def _frame_name(frame: str) -> str:
    """py-spy's 'function (file.py:line)' without the line: one entry per function."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0].rsplit('/', 1)[-1]})" if where else name


def summarize(raw: Path, top: int) -> str:
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_frame_name(f) for f in stack.split(";")]
        n = int(count)
        total += n
        own[frames[-1]] += n
        for name in set(frames):
            inclusive[name] += n
    out = [f"{total} samples", "own time:"]
    out += [f"  {100 * n / total:5.1f}%  {name}" for name, n in own.most_common(top)]
    out.append("inclusive:")
    out += [f"  {100 * n / total:5.1f}%  {name}" for name, n in inclusive.most_common(top + 10)
            if not name.startswith(("process ", "thread ", "<module>", "_bootstrap", "run (threading"))][:top]
    return "\n".join(out)


def profile(pid: int, prompts: list[str], url: str, clients: int, seconds: int, out: Path) -> None:
    stop = threading.Event()

    def load():
        while not stop.is_set():
            asyncio.run(run_row(url, "mc", prompts, clients, 32))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    subprocess.run(["py-spy", "record", "--pid", str(pid), "--subprocesses", "--format", "raw",
                    "--duration", str(seconds), "--rate", "200", "--output", str(out), "--nonblocking"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop.set()
    thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--set", action="append", default=[], help="passed to megacli serve")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="megacli-serve-profile-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "mc").exists():
        build(workdir, 256, 4)
    extra = [x for kv in args.set for x in ("--set", kv)]
    proc, url = start_server(workdir, max_batch=16, extra=extra)
    try:
        for clients in (1, 16):
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(clients * 2)]
            asyncio.run(run_row(url, "mc", prompts, clients, 32))  # warm-up
            raw = workdir / f"profile_{clients}.txt"
            profile(proc.pid, prompts, url, clients, args.seconds, raw)
            print(f"## {clients} client(s)\n{summarize(raw, args.top)}\n", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    main()
