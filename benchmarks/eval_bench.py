"""`megacli eval` speed on CPU next to lm-evaluation-harness's own Hugging Face backend (`hf`):
the same random Llama-shaped model (converted with `megacli convert`), the same four local tasks
(LAMBADA-style last word, multiple choice, rolling perplexity, greedy generate_until), the same
batch size. Prints each side's model tokens per second and the ratio, from one run each.

    python benchmarks/eval_bench.py [--workdir DIR] [--hidden 256] [--layers 4] [--docs 24] [--batch-size 8]

Each side runs in a process of its own and loads its model before the clock starts; the clock
covers the harness's whole simple_evaluate (request building, the model, metrics). Tokens are
counted once, by megacli (prompt and scored tokens run through the model, plus generated ones), so
the ratio is the ratio of wall times. Also checks that the two sides' metrics agree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the quick brown fox jumps over the lazy dog while a small model of the world reads every step "
         "of the loop and numbers a person can check").split()
TASKS = ["bench_lambada", "bench_choice", "bench_rolling", "bench_generate"]


def build(workdir: Path, hidden: int, layers: int, docs: int) -> None:
    """A random Llama (Hugging Face directory + megacli conversion) and the four tasks' data."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from megacli.convert import convert

    rng = random.Random(0)
    sentence = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    hf = workdir / "hf"
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         max_position_embeddings=256, architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(hf)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([sentence(12) for _ in range(500)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>").save_pretrained(hf)
    convert(hf, workdir / "mc", say=lambda *_: None)

    data = {
        "bench_lambada": [{"text": sentence(rng.randint(10, 40))} for _ in range(docs)],
        "bench_choice": [{"question": sentence(rng.randint(8, 30)), "choices": [sentence(rng.randint(1, 6)) for _ in range(4)],
                          "label": rng.randrange(4)} for _ in range(docs)],
        "bench_rolling": [{"text": sentence(rng.randint(50, 400))} for _ in range(docs)],
        "bench_generate": [{"prompt": sentence(rng.randint(8, 40)), "answer": "fox"} for _ in range(docs)],
    }
    bodies = {
        "bench_lambada": "output_type: loglikelihood\ndoc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
                         "doc_to_target: \"{{' ' + text.split(' ')[-1]}}\"\nmetric_list:\n  - {metric: perplexity, "
                         "aggregation: perplexity, higher_is_better: false}\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n",
        "bench_choice": "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
                        "doc_to_target: \"{{label}}\"\nmetric_list:\n  - {metric: acc}\n  - {metric: acc_norm}\n",
        "bench_rolling": "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                         "metric_list:\n  - {metric: word_perplexity}\n",
        "bench_generate": "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{answer}}\"\n"
                          "generation_kwargs: {until: [\"zebra\"], max_gen_toks: 24, do_sample: false}\n"
                          "metric_list:\n  - {metric: exact_match, aggregation: mean, higher_is_better: true}\n",
    }
    tasks = workdir / "tasks"
    tasks.mkdir(exist_ok=True)
    for name, rows in data.items():
        file = workdir / f"{name}.jsonl"
        file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {file}\ntest_split: test\n"
        (tasks / f"{name}.yaml").write_text(head + bodies[name])


def _evaluate(lm, workdir: Path, batch_size: int) -> tuple[dict, float]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(workdir / "tasks"))
    start = time.perf_counter()
    results = simple_evaluate(model=lm, tasks=TASKS, task_manager=manager, batch_size=batch_size, log_samples=False,
                              bootstrap_iters=0)
    seconds = time.perf_counter() - start
    metrics = {t: {k: v for k, v in r.items() if "," in k and "stderr" not in k} for t, r in results["results"].items()}
    return metrics, seconds


def hf_side(workdir: Path, batch_size: int) -> dict:
    import torch
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(workdir / "hf"), dtype="float32", batch_size=batch_size, device="cpu")
    metrics, seconds = _evaluate(lm, workdir, batch_size)
    return {"metrics": metrics, "seconds": seconds, "threads": torch.get_num_threads()}


def megacli_side(workdir: Path, batch_size: int) -> dict:
    from megacli.data.tokenizers import load_tokenizer
    from megacli.engine import distributed
    from megacli.inference.lm_eval_backend import Lockstep, MegacliLM, Work
    from megacli.inference.runner import Model
    from megacli.recipe import base
    from megacli.recipe.eval import EvalRecipe

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29534")
    raw = base.read_yaml(next((workdir / "mc").glob("iter_*")) / "recipe.yaml")
    raw["launch"]["device"] = "cpu"
    raw["train"]["global_batch_size"] = raw["train"]["micro_batch_size"]
    recipe = base.validate(EvalRecipe, {**raw, "generate": {"checkpoint": str(workdir / "mc")},
                                        "eval": {"tasks": TASKS, "batch_size": batch_size}}, "bench")
    runtime = distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=0)
    tok = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path)
    model = Model(recipe, runtime, vocab_size=recipe.model.vocab_size)
    lm = MegacliLM(Lockstep(Work(model, tok, seed=0), world_size=1), tok, max_length=recipe.model.max_positions,
                   batch_size=batch_size, max_gen_toks=256, add_bos=False)
    metrics, seconds = _evaluate(lm, workdir, batch_size)
    distributed.teardown()
    return {"metrics": metrics, "seconds": seconds, "tokens": sum(t["tokens"] for t in lm.timing.report().values()),
            "params": sum(p.numel() for p in model.net.parameters())}


def _agree(a: dict, b: dict) -> bool:
    return all(abs(a[t][k] - b[t][k]) <= 1e-4 * max(abs(b[t][k]), 1e-9) for t in b for k in b[t])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--docs", type=int, default=24, help="documents per task")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--side", choices=["hf", "megacli"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="megacli-eval-bench-"))
    if args.side:
        result = (hf_side if args.side == "hf" else megacli_side)(workdir, args.batch_size)
        (workdir / f"result_{args.side}.json").write_text(json.dumps(result))
        return
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "mc").exists():
        build(workdir, args.hidden, args.layers, args.docs)
    results = {}
    for side in ("hf", "megacli"):
        subprocess.run([sys.executable, __file__, "--side", side, "--workdir", str(workdir), "--batch-size",
                        str(args.batch_size)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results[side] = json.loads((workdir / f"result_{side}.json").read_text())
    tokens = results["megacli"]["tokens"]
    hf_rate, ours_rate = tokens / results["hf"]["seconds"], tokens / results["megacli"]["seconds"]
    print(f"model: random Llama {results['megacli']['params'] / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} "
          f"layers), fp32, {results['hf']['threads']} threads; tasks {', '.join(TASKS)}, {args.docs} documents each, "
          f"batch size {args.batch_size}; one run per side, each in its own process")
    print(f"metrics agree to 1e-4: {_agree(results['megacli']['metrics'], results['hf']['metrics'])}")
    print(f"  harness hf backend {results['hf']['seconds']:8.2f} s  {hf_rate:8.1f} tokens/s")
    print(f"  megacli eval       {results['megacli']['seconds']:8.2f} s  {ours_rate:8.1f} tokens/s")
    print(f"  ratio megacli/hf: {ours_rate / hf_rate:.2f}x ({tokens} model tokens)")


if __name__ == "__main__":
    main()
