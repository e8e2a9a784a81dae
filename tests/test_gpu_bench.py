"""benchmarks/gpu_bench.py at its tiny size on CPU: the three sides (megacli in each of its
variants, raw Megatron-Core, plain PyTorch) run and report positive numbers in the JSON, so the
GPU run is known to work; a variant that cannot run here (CUDA graphs on CPU) is recorded with its
reason while the others still run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_tiny_benchmark_reports_every_side(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--tiny", "--device", "cpu", "--sizes", "124m",
           "--steps", "2", "--warmup", "1", "--accum", "1", "--compile", "none", "--json", str(out),
           "--megacli-set", "optim.clip_grad=0.5", "--variants", "default,unfused,compile,graphs"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]  # the graphs variant failed
    report = json.loads(out.read_text())
    assert report["tiny"] and report["steps"] == 2 and report["peak_tflops"] == 989.4
    assert report["megacli_sets"] == ["optim.clip_grad=0.5"]
    assert report["variants"] == {"default": [], "unfused": ["optim.fused=false"], "compile": ["train.compile=true"],
                                  "graphs": ["train.cuda_graphs=layers"]}
    sides = report["results"]["124m"]
    megacli = ["megacli:default", "megacli:unfused", "megacli:compile"]
    assert list(sides) == [*megacli, "megacli:graphs", "megatron", "pytorch", "ratios"]
    assert "train.cuda_graphs = 'layers' captures CUDA graphs; this run is on cpu" in sides["megacli:graphs"]["error"]
    assert "megacli:graphs failed: " in res.stdout
    assert sides["megacli:compile"]["megacli_sets"] == ["train.compile=true", "optim.clip_grad=0.5"]
    params = {sides[s]["params"] for s in (*megacli, "megatron", "pytorch")}
    assert len(params) == 1, "the sides train the same model"
    for side in (*megacli, "megatron", "pytorch"):
        r = sides[side]
        assert r["steps_timed"] == 2, (side, r)
        for key in ("step_time_s", "tokens_per_s", "tflops", "mfu", "peak_memory_gib"):
            assert r[key] > 0, (side, key, r)
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(2 * 64), "micro-batch 2 × 64 tokens"
    ratios = sides["ratios"]
    assert sorted(ratios) == sorted(f"{m}_over_{o}" for m in megacli for o in ("megatron", "pytorch"))
    assert all(value > 0 for value in ratios.values())
    assert "megacli:compile/pytorch" in res.stdout, res.stdout
