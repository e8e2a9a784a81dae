"""`megacli generate` decoding speed on CPU: new tokens per second with and without the KV cache,
next to Hugging Face `generate` (greedy, its own KV cache) on the same converted model, at
batch 1 and batch 8. Also checks that all produce the same tokens.

    python benchmarks/generate_bench.py [--workdir DIR] [--hidden 512] [--layers 8] [--new 64] [--repeats 5]

A random Llama-shaped model (RoPE, GQA, SwiGLU, RMSNorm) is saved as a Hugging Face directory
and converted with `megacli convert`. Each side runs in a process of its own (Hugging Face without
megacli's CPU backend, as its users run it), the two alternating --rounds times so machine noise
hits both alike. Reported: the median of new tokens / wall second (prefill included, as a user
waits for it), and our/HF ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["the quick brown fox", "a model of the world is not the world itself", "once upon a time in a small",
           "tensor and pipeline parallel layouts", "every step of the loop", "numbers a person can check",
           "the lazy dog sleeps", "checkpoints that convert"]


def build(workdir: Path, hidden: int, layers: int) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from megacli.checkpoint.source import Source
    from megacli.convert import convert

    hf = workdir / "hf"
    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         max_position_embeddings=1024, architectures=["LlamaForCausalLM"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(hf)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(PROMPTS * 50, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(hf)
    convert(Source(hf), workdir / "mc", say=lambda *_: None)
    return hf


def hf_side(workdir: Path, new: int, repeats: int) -> dict:
    """Hugging Face generate in a process of its own (no megacli CPU backend in it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(workdir / "hf", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(workdir / "hf")
    tok.padding_side, tok.pad_token = "left", tok.eos_token

    def run(prompts):
        enc = tok(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = hf.generate(**enc, do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.pad_token_id)
        return [row[enc["input_ids"].shape[1]:].tolist() for row in out]

    return {"HF generate": _measure(run, new, repeats), "params": sum(p.numel() for p in hf.parameters()),
            "threads": torch.get_num_threads()}


def megacli_side(workdir: Path, new: int, repeats: int) -> dict:
    from megacli.data.tokenizers import load_tokenizer
    from megacli.engine import distributed
    from megacli.inference.generator import Generator
    from megacli.inference.runner import Model
    from megacli.recipe import base
    from megacli.recipe.generate import GenerateRecipe

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29533")
    raw = base.read_yaml(next((workdir / "mc").glob("iter_*")) / "recipe.yaml")
    raw["launch"]["device"] = "cpu"
    raw["train"]["global_batch_size"] = raw["train"]["micro_batch_size"]
    common = {"checkpoint": str(workdir / "mc"), "max_new_tokens": new, "stop_at_eod": False, "batch_size": 8, "stream": False}
    recipes = {cache: base.validate(GenerateRecipe, {**raw, "generate": {**common, "use_cache": cache}}, "bench")
               for cache in (True, False)}
    runtime = distributed.setup(parallel=recipes[True].parallel, launch=recipes[True].launch, seed=0)
    tok = load_tokenizer(type="huggingface", path=str(workdir / "hf"))
    model = Model(recipes[True], runtime, vocab_size=recipes[True].model.vocab_size)
    out = {}
    for cache, label in ((True, "megacli (KV cache)"), (False, "megacli (no cache)")):
        gen = Generator(model, tok, recipes[cache].generate)
        out[label] = _measure(lambda prompts: [c.tokens for c in gen.run_batch(prompts)], new, repeats)
    distributed.teardown()
    return out


def _measure(run, new: int, repeats: int) -> dict:
    """Per batch size: new tokens/s of each repeat (after one warm-up) and the tokens produced."""
    out = {}
    for batch in (1, 8):
        prompts = PROMPTS[:batch]
        tokens = run(prompts)
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(prompts)
            rates.append(batch * new / (time.perf_counter() - start))
        out[str(batch)] = {"rates": rates, "tokens": tokens}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="alternate the two sides' processes this many times")
    ap.add_argument("--side", choices=["hf", "megacli"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="megacli-generate-bench-"))
    if args.side:
        result = (hf_side if args.side == "hf" else megacli_side)(workdir, args.new, args.repeats)
        (workdir / f"result_{args.side}.json").write_text(json.dumps(result))
        return
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "mc").exists():
        build(workdir, args.hidden, args.layers)
    merged: dict = {}
    for _ in range(args.rounds):
        for side in ("hf", "megacli"):
            subprocess.run([sys.executable, __file__, "--side", side, "--workdir", str(workdir), "--new", str(args.new),
                            "--repeats", str(args.repeats)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            result = json.loads((workdir / f"result_{side}.json").read_text())
            for label, per_batch in result.items():
                if not isinstance(per_batch, dict):
                    merged[label] = per_batch
                    continue
                for batch, r in per_batch.items():
                    slot = merged.setdefault(label, {}).setdefault(batch, {"rates": [], "tokens": r["tokens"]})
                    slot["rates"] += r["rates"]
    print(f"model: random Llama {merged['params'] / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers), fp32, "
          f"{merged['threads']} threads; {args.new} new tokens per prompt; greedy; median of {args.rounds} × {args.repeats} "
          f"runs, each side in its own process")
    labels = ["megacli (KV cache)", "megacli (no cache)", "HF generate"]
    for batch in ("1", "8"):
        med = {k: statistics.median(merged[k][batch]["rates"]) for k in labels}
        same = merged[labels[0]][batch]["tokens"] == merged[labels[1]][batch]["tokens"] == merged[labels[2]][batch]["tokens"]
        print(f"\nbatch {batch}: tokens equal across all three: {same}")
        for k in labels:
            print(f"  {k:20s} {med[k]:8.1f} new tokens/s")
        print(f"  ratio megacli/HF: {med[labels[0]] / med[labels[2]]:.2f}x; KV cache vs none: {med[labels[0]] / med[labels[1]]:.2f}x")


if __name__ == "__main__":
    main()
