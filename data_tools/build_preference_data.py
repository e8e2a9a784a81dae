"""Build a small preference set for recipes/dpo_tiny.yaml from the local corpus (no network).

Each pair continues a line of a docstring: the prompt is "lower:" or "UPPER:" (at random) and the
line's first words, both completions are its next words, the chosen one in the case the prompt asks
for and the rejected one in the other. Neither case is preferred overall, so the policy has to read
the prompt: a tiny model learns it in a few dozen steps, and the held-out reward accuracy shows
preference tuning working. Half the pairs are plain strings, half
chat messages (TRL's two formats).

    python data_tools/build_preference_data.py --corpus data/corpus.jsonl --out data/preference
    megacli finetune recipes/dpo_tiny.yaml
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def pairs_from_texts(texts, *, n: int, seed: int, prompt_words: int = 6, completion_words: int = 3) -> list[dict]:
    """Up to ``n`` pairs from lines of the texts with enough words, in a seeded order."""
    rng = random.Random(seed)
    lines = [line.split() for text in texts for line in text.splitlines()]
    lines = [w for w in lines if len(w) >= prompt_words + completion_words]
    rng.shuffle(lines)
    out = []
    for words in lines[:n]:
        rest = " ".join(words[prompt_words:prompt_words + completion_words])
        lower, upper = " " + rest.lower(), " " + rest.upper()
        if lower == upper:  # no letters to tell them apart
            continue
        wants_upper = rng.random() < 0.5
        prompt = ("UPPER: " if wants_upper else "lower: ") + " ".join(words[:prompt_words])
        chosen, rejected = (upper, lower) if wants_upper else (lower, upper)
        if len(out) % 2:
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        else:
            out.append({"prompt": [{"role": "user", "content": prompt}],
                        "chosen": [{"role": "assistant", "content": chosen.strip()}],
                        "rejected": [{"role": "assistant", "content": rejected.strip()}]})
    return out


def write(pairs: list[dict], out: Path, *, valid_share: float = 0.1) -> tuple[int, int]:
    """train.jsonl and valid.jsonl (the last valid_share of the pairs) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    cut = len(pairs) - max(1, int(len(pairs) * valid_share))
    for name, part in (("train.jsonl", pairs[:cut]), ("valid.jsonl", pairs[cut:])):
        (out / name).write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in part), encoding="utf-8")
    return cut, len(pairs) - cut


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus.jsonl"))
    ap.add_argument("--out", type=Path, default=Path("data/preference"))
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    texts = [json.loads(line)["text"] for line in args.corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    n_train, n_valid = write(pairs_from_texts(texts, n=args.pairs, seed=args.seed), args.out)
    print(f"wrote {n_train} training and {n_valid} held-out preference pairs to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
