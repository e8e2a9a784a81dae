#!/usr/bin/env python
"""Train a GPT-2-style byte-level BPE tokenizer (Hugging Face ``tokenizers``) on a JSONL corpus and
save it as a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json) that
``transformers.AutoTokenizer.from_pretrained(dir)``, megacli and Megatron-LM's
``--tokenizer-type HuggingFaceTokenizer`` all load.

    python data_tools/train_tokenizer.py --input data/corpus.jsonl --output data/tokenizer --vocab-size 4096

``<|endoftext|>`` is the only special token (id 0) and serves as end of document, beginning of
sequence and unknown token, as in GPT-2. A standalone tool: megacli never imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterator

EOD = "<|endoftext|>"


def texts(paths: list[str], key: str) -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)[key]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, nargs="+", help="JSONL file(s) to train on.")
    parser.add_argument("--output", required=True, help="Directory to save the tokenizer in.")
    parser.add_argument("--vocab-size", type=int, default=4096, help="Vocabulary size, special token included (default 4096).")
    parser.add_argument("--json-key", default="text", help="Key of the text in each JSON line (default text).")
    parser.add_argument("--min-frequency", type=int, default=2, help="Minimum count of a merged pair (default 2).")
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if args.vocab_size < 257:
        parser.error("--vocab-size must be at least 257 (256 byte symbols + <|endoftext|>)")
    start = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(args.input, args.json_key), trainer=trainer)

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOD, eos_token=EOD, unk_token=EOD)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out))
    print(f"saved {out}: {tokenizer.get_vocab_size()} tokens, {EOD} = {tokenizer.token_to_id(EOD)}, "
          f"trained in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
