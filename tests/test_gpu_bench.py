"""benchmarks/gpu_bench.py at its tiny size on CPU: the three sides (megacli in each of its
variants, raw Megatron-Core, plain PyTorch) run and report positive numbers in the JSON, so the
GPU run is known to work; a variant that cannot run here (CUDA graphs on CPU) is recorded with its
reason while the others still run; the FP8 variant (emulated, the megacli sides in bf16) is
reported over its bf16 counterpart with both losses."""

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
           "--megacli-set", "optim.clip_grad=0.5", "--megacli-set", "train.precision=bf16",
           "--megacli-set", "train.fp8_emulate=true", "--variants", "default,unfused,compile,graphs,fp8"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]  # the graphs variant failed
    report = json.loads(out.read_text())
    assert report["tiny"] and report["steps"] == 2 and report["peak_tflops"] == 989.4
    sets = ["optim.clip_grad=0.5", "train.precision=bf16", "train.fp8_emulate=true"]
    assert report["megacli_sets"] == sets
    assert report["variants"] == {"default": [], "unfused": ["optim.fused=false"], "compile": ["train.compile=true"],
                                  "graphs": ["train.cuda_graphs=layers"], "fp8": ["train.fp8=tensorwise"]}
    sides = report["results"]["124m"]
    megacli = ["megacli:default", "megacli:unfused", "megacli:compile", "megacli:fp8"]
    assert list(sides) == [*megacli[:3], "megacli:graphs", "megacli:fp8", "megatron", "pytorch", "ratios", "fp8_loss"]
    assert "train.cuda_graphs = 'layers' captures CUDA graphs; this run is on cpu" in sides["megacli:graphs"]["error"]
    assert "megacli:graphs failed: " in res.stdout
    assert sides["megacli:compile"]["megacli_sets"] == ["train.compile=true", *sets]
    params = {sides[s]["params"] for s in (*megacli, "megatron", "pytorch")}
    assert len(params) == 1, "the sides train the same model"
    for side in (*megacli, "megatron", "pytorch"):
        r = sides[side]
        assert r["steps_timed"] == 2, (side, r)
        for key in ("step_time_s", "tokens_per_s", "tflops", "mfu", "peak_memory_gib"):
            assert r[key] > 0, (side, key, r)
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(2 * 64), "micro-batch 2 × 64 tokens"
    ratios = sides["ratios"]
    assert sorted(ratios) == sorted([*(f"{m}_over_{o}" for m in megacli for o in ("megatron", "pytorch")),
                                     "megacli:fp8_over_megacli:default"])
    assert all(value > 0 for value in ratios.values())
    assert "megacli:compile/pytorch" in res.stdout and "megacli:fp8/megacli:default" in res.stdout, res.stdout
    loss = sides["fp8_loss"]["megacli:fp8"]
    assert loss["bf16_side"] == "megacli:default" and loss["final_loss"] != loss["bf16_final_loss"]
    assert loss["relative_gap"] == pytest.approx(abs(loss["final_loss"] - loss["bf16_final_loss"]) / loss["bf16_final_loss"])
    assert loss["final_loss"] == sides["megacli:fp8"]["final_loss"] and loss["within_tolerance"] == (loss["relative_gap"] <= 5e-3)
