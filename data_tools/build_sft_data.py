"""Build a small instruction set and a small "downloaded" model for recipes/sft_tiny.yaml, from local
files only (no network):

* --data: instruction JSONL from the local corpus (data/corpus.jsonl, docstrings): tasks whose
  answers are in the text (first line of a docstring, its first word, its word count), half as
  {"prompt", "response"} pairs, half as chat {"messages"};
* --model: a tiny random Llama-shaped Hugging Face model with the local tokenizer (the shape of
  the recipe's model: section), which `megacli convert` then turns into the starting checkpoint.

    python data_tools/build_sft_data.py --corpus data/corpus.jsonl --data data/sft --model data/tiny_llama_hf
    megacli convert data/tiny_llama_hf data/tiny_llama
    megacli finetune recipes/sft_tiny.yaml
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def tasks(text: str):
    first = text.strip().splitlines()[0].strip()
    words = first.split()
    yield f"What is the first line of this text?\n{text[:300]}", first
    yield f"What is the first word of: {first}", words[0]
    yield f"How many words are in: {first}", str(len(words))


def build_data(corpus: Path, out: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    docs = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    docs = [d for d in docs if d.strip() and len(d.strip().splitlines()[0].split()) >= 3]
    rng.shuffle(docs)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for doc in docs:
        for prompt, answer in tasks(doc):
            if len(records) % 2:
                records.append({"prompt": prompt + "\n", "response": answer})
            else:
                records.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
        if len(records) >= n:
            break
    cut = int(len(records) * 0.95)
    for name, part in (("train.jsonl", records[:cut]), ("valid.jsonl", records[cut:])):
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")
    print(f"wrote {cut} training and {len(records) - cut} validation records to {out}")


def build_model(recipe: Path, tokenizer: Path, out: Path, seed: int) -> None:
    import shutil

    import torch
    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    m = yaml.safe_load(recipe.read_text())["model"]
    vocab = json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"]
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
                         num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
                         num_key_value_heads=m.get("num_query_groups") or m["num_attention_heads"],
                         max_position_embeddings=m["seq_length"], rope_theta=float(m.get("rotary_base", 10000.0)),
                         rms_norm_eps=1e-5, tie_word_embeddings=not m.get("untie_embeddings", False),
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    for f in tokenizer.iterdir():
        shutil.copy(f, out / f.name)
    print(f"wrote a random Llama ({m['num_layers']} layers, hidden {m['hidden_size']}, "
          f"vocab {len(vocab)}) to {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus.jsonl"))
    ap.add_argument("--data", type=Path, help="output directory for train.jsonl and valid.jsonl")
    ap.add_argument("--records", type=int, default=6000)
    ap.add_argument("--model", type=Path, help="output directory for the Hugging Face model")
    ap.add_argument("--recipe", type=Path, default=Path("recipes/sft_tiny.yaml"), help="its model: section sizes the model")
    ap.add_argument("--tokenizer", type=Path, default=Path("data/tokenizer"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.data:
        build_data(args.corpus, args.data, args.records, args.seed)
    if args.model:
        build_model(args.recipe, args.tokenizer, args.model, args.seed)


if __name__ == "__main__":
    main()
