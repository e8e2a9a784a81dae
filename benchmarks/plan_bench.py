"""How long `megacli plan` takes for a 70B-class recipe on 1,024 GPUs (the goal: under 10 s on 2 CPU
cores; it runs on one), as the command runs it (a fresh interpreter each time), and whether torch was imported.

    python benchmarks/plan_bench.py [--runs 3] [--recipe recipes/llama2_70b.yaml] [--gpus 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import sys, json; from megacli.cli import _register, app; _register(); "
         "app(['plan', {recipe!r}, '--gpus', '{gpus}', '--json', '--top', '1'], standalone_mode=False); "
         "print(json.dumps({{'torch': 'torch' in sys.modules}}), file=sys.stderr)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--recipe", default="recipes/llama2_70b.yaml")
    ap.add_argument("--gpus", type=int, default=1024)
    args = ap.parse_args()
    times, cpu, torch_seen, top = [], [], False, None
    for _ in range(args.runs):
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", PROBE.format(recipe=args.recipe, gpus=args.gpus)], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime)
        torch_seen |= json.loads(out.stderr.strip().splitlines()[-1])["torch"]
        top = json.loads(out.stdout)[0]
    print(f"megacli plan {args.recipe} --gpus {args.gpus}: median {statistics.median(times):.2f} s over {args.runs} runs "
          f"({', '.join(f'{t:.2f}' for t in times)}); CPU time median {statistics.median(cpu):.2f} s "
          f"(one core; wall time grows with the machine's load, {os.getloadavg()[0]:.1f} now); torch imported: {torch_seen}")
    print(f"top layout: TP{top['tensor']} PP{top['pipeline']} VP{top['virtual_pipeline']} CP{top['context']} "
          f"DP{top['data']} mbs {top['micro_batch_size']} {top['recompute']}, {top['tokens_per_second_per_gpu']:,.0f} "
          f"tokens/s/GPU, MFU {top['mfu']:.1%}, {top['memory_gib']['total']:.1f} GiB")


if __name__ == "__main__":
    main()
