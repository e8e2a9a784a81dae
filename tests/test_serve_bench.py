"""benchmarks/serve_bench.py --against transformers at its tiny size: both servers start on the same
model, every row prints every side with its load average, throughput, latency and time to first
token, and megacli's prefix cache leaves the greedy texts as they are (the script asserts it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

pytest.importorskip("fastapi")
pytest.importorskip("openai")


@pytest.mark.slow
def test_tiny_benchmark_against_transformers_serve(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_bench.py"), "--against", "transformers", "--tiny",
           "--repeats", "2", "--workdir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in res.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header, rows = rows[0], rows[1:]
    assert [c.strip() for c in header] == ["row", "side", "load avg (1 min)", "tokens/s", "ratio", "p50 / p99 latency",
                                           "p50 / p99 TTFT"]
    sides = [(r[0].strip(), r[1].strip()) for r in rows]
    assert sides == [("2 x 2, 8", "transformers"), ("2 x 2, 8", "megacli")] + [
        (sides[-1][0], s) for s in ("transformers", "megacli, no prefix cache", "megacli")]
    assert sides[-1][0].startswith("shared prefix")
    for row in rows:
        assert float(row[2]) >= 0 and float(row[3]) > 0
        latency, ttft = (tuple(float(x.strip(" s")) for x in cell.split("/")) for cell in row[5:7])
        assert 0 < latency[0] <= latency[1] and 0 < ttft[0] <= ttft[1] and ttft[0] <= latency[1]
    assert "x vs transformers" in rows[1][4] and "x vs megacli, no prefix cache" in rows[-1][4]
