#!/usr/bin/env python
"""Train a BERT-style WordPiece vocabulary (Hugging Face ``tokenizers``) on a JSONL corpus and write
it as a ``vocab.txt`` that megacli (``tokenizer.type: wordpiece``), Megatron-LM's
``--tokenizer-type BertWordPieceLowerCase/BertWordPieceCase`` and ``transformers.BertTokenizer`` load.

    python data_tools/train_wordpiece.py --input data/corpus.jsonl --output data/wordpiece --vocab-size 8192

The vocabulary starts with BERT's special tokens ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (ids 0-4; [PAD]
= 0 as Megatron's BERT dataset expects); word continuations carry the ``##`` prefix, which is what
whole-word masking looks for. Lower-cased by default (``--cased`` keeps case; megacli and Megatron
pick lower-casing from the vocabulary). A standalone tool: megacli never imports it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from train_tokenizer import texts  # same folder: scripts run as `python data_tools/...`

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, nargs="+", help="JSONL file(s) to train on.")
    parser.add_argument("--output", required=True, help="Directory to write vocab.txt in.")
    parser.add_argument("--vocab-size", type=int, default=8192, help="Vocabulary size, special tokens included (default 8192).")
    parser.add_argument("--json-key", default="text", help="Key of the text in each JSON line (default text).")
    parser.add_argument("--min-frequency", type=int, default=2, help="Minimum count of a merged pair (default 2).")
    parser.add_argument("--cased", action="store_true", help="Keep upper case (default: lower-case, accents stripped).")
    args = parser.parse_args(argv)

    from tokenizers import BertWordPieceTokenizer

    if args.vocab_size <= len(SPECIALS):
        parser.error(f"--vocab-size must be larger than the {len(SPECIALS)} special tokens")
    start = time.perf_counter()
    lower = not args.cased
    tokenizer = BertWordPieceTokenizer(lowercase=lower, strip_accents=lower, clean_text=True, handle_chinese_chars=True)
    tokenizer.train_from_iterator(texts(args.input, args.json_key), vocab_size=args.vocab_size,
                                  min_frequency=args.min_frequency, special_tokens=SPECIALS, show_progress=False,
                                  wordpieces_prefix="##")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    assert [t for t, _ in vocab[:len(SPECIALS)]] == SPECIALS, vocab[:len(SPECIALS)]
    (out / "vocab.txt").write_text("".join(t + "\n" for t, _ in vocab), encoding="utf-8")
    print(f"saved {out / 'vocab.txt'}: {len(vocab)} tokens ({'lower-cased' if lower else 'cased'}), "
          f"trained in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
