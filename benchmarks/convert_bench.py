"""`megacli convert` on a ~1B-parameter random Llama (the Llama-3.2-1B shape, bf16): HF -> megacli
-> HF, next to a plain `save_pretrained` of the same model. Prints seconds and peak RSS per step
and checks that the round trip is bitwise.

    python benchmarks/convert_bench.py [--workdir DIR] [--layers 16] [--keep]

Each step runs in its own process. Peak RSS is that process's ru_maxrss; peak PSS is sampled
(every 0.25 s) over the process and the helper processes it starts (dist_checkpointing writes from
forked processes that share the parent's pages), so it is the step's whole physical footprint.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 1024**3

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                bos_token_id=128000, eos_token_id=128001, architectures=["LlamaForCausalLM"])


class TreeMemory:
    """Samples the proportional set size (PSS) of this process plus its helper processes: forked
    writers share the parent's pages copy-on-write, so their RSS would count those pages twice."""

    def __init__(self, interval: float = 0.25):
        import threading

        import psutil

        self.peak = 0
        self._me = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            total = 0
            for p in [self._me, *self._me.children(recursive=True)]:
                try:
                    total += p.memory_full_info().pss
                except Exception:  # noqa: BLE001 - a helper that just exited
                    pass
            self.peak = max(self.peak, total)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / GIB


def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def step_make(work: Path, layers: int) -> dict:
    """A random bf16 Llama saved with save_pretrained (weights drawn directly in bf16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_1B, num_hidden_layers=layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
    n = sum(p.numel() for p in model.parameters())
    t = time.perf_counter()
    model.save_pretrained(work / "hf", max_shard_size="2GB")
    return {"params": n, "seconds": time.perf_counter() - t}


def step_plain_save(work: Path) -> dict:
    """The baseline: load the HF model and save_pretrained it (what an HF-only round trip costs)."""
    import torch
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(work / "hf", dtype=torch.bfloat16)
    loaded = time.perf_counter()
    model.save_pretrained(work / "hf_plain", max_shard_size="2GB")
    return {"seconds": time.perf_counter() - t, "load_seconds": loaded - t, "save_seconds": time.perf_counter() - loaded}


def step_import(work: Path) -> dict:
    from megacli.convert import convert

    t = time.perf_counter()
    convert(work / "hf", work / "mc", dtype="bf16", say=lambda s: None)
    return {"seconds": time.perf_counter() - t}


def step_export(work: Path) -> dict:
    from megacli.convert import convert

    t = time.perf_counter()
    convert(work / "mc", work / "hf_out", max_shard_size="2GB", say=lambda s: None)
    return {"seconds": time.perf_counter() - t}


def step_verify(work: Path) -> dict:
    """Every tensor of the export equals the source's, bit for bit (read one at a time)."""
    from safetensors import safe_open

    def tensors(root: Path):
        index = root / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
        where = {}
        for f in files:
            with safe_open(str(root / f), framework="pt") as h:
                where.update({k: root / f for k in h.keys()})
        return where

    src, out = tensors(work / "hf"), tensors(work / "hf_out")
    same = sorted(src) == sorted(out)
    for key in src:
        with safe_open(str(src[key]), framework="pt") as a, safe_open(str(out[key]), framework="pt") as b:
            same = same and bool((a.get_tensor(key) == b.get_tensor(key)).all()) and a.get_tensor(key).dtype == b.get_tensor(key).dtype
    return {"bitwise_round_trip": same, "tensors": len(src)}


STEPS = {"make": step_make, "plain_save": step_plain_save, "import": step_import, "export": step_export, "verify": step_verify}


def run_step(name: str, work: Path, layers: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--step", name, "--workdir", str(work), "--layers", str(layers)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"step {name} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _size(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / GIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--step", choices=list(STEPS), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.step:
        kwargs = {"layers": a.layers} if a.step == "make" else {}
        tree = TreeMemory()
        result = STEPS[a.step](a.workdir, **kwargs)
        print(json.dumps({**result, "peak_rss_gib": _peak_rss_gib(), "peak_tree_pss_gib": tree.stop()}))
        return
    work = a.workdir or Path(tempfile.mkdtemp(prefix="convert_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        made = run_step("make", work, a.layers)
        print(f"random Llama, {made['params'] / 1e9:.2f}B parameters, bf16: {_size(work / 'hf'):.2f} GiB of safetensors")
        rows = [("save_pretrained of the model in memory", made),
                ("from_pretrained + save_pretrained", run_step("plain_save", work, a.layers)),
                ("megacli convert HF -> megacli", run_step("import", work, a.layers)),
                ("megacli convert megacli -> HF", run_step("export", work, a.layers))]
        print(f"{'step':<38}{'seconds':>9}{'peak RSS GiB':>14}{'peak PSS GiB (with helpers)':>29}")
        for label, r in rows:
            print(f"{label:<38}{r['seconds']:>9.1f}{r['peak_rss_gib']:>14.2f}{r['peak_tree_pss_gib']:>29.2f}")
        size = _size(work / "hf")
        plain, imported, exported = rows[1][1], rows[2][1], rows[3][1]
        print(f"HF -> megacli time / (from_pretrained + save_pretrained): {imported['seconds'] / plain['seconds']:.2f}x (goal <= 2x); "
              f"megacli -> HF: {exported['seconds'] / plain['seconds']:.2f}x")
        print(f"HF -> megacli peak RSS / model size: {imported['peak_rss_gib'] / size:.2f}x, with helpers' PSS "
              f"{imported['peak_tree_pss_gib'] / size:.2f}x (goal <= 1.2x); megacli -> HF: {exported['peak_rss_gib'] / size:.2f}x")
        check = run_step("verify", work, a.layers)
        print(f"round trip bitwise identical over {check['tensors']} tensors: {check['bitwise_round_trip']}")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
