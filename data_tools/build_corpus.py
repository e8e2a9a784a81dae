#!/usr/bin/env python
"""Build a real English corpus as JSONL (``{"text": ...}`` per line) from what is installed here,
with no network: the docstrings of the Python standard library and of the installed packages.

    python data_tools/build_corpus.py --output data/corpus.jsonl              # ~8 MB, a few seconds
    python data_tools/build_corpus.py --output data/big.jsonl --min-mb 50     # benchmark size

Sources are read in a fixed order (stdlib, then site-packages, each sorted), so the same machine
always gives the same corpus. ``--min-mb`` beyond what the sources hold is reached by further
passes that recombine the documents (each document joined with the paragraphs of another one,
in an order that differs per pass), so the text stays real English but no document repeats.

A standalone tool: megacli never imports it.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import random
import re
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterator

# Any triple-quoted literal: docstrings are nearly always written this way. Faster than ast by
# an order of magnitude; the filter below throws away the literals that are code, not prose.
TRIPLE_QUOTED = re.compile(rb'("""|\'\'\')(.*?)\1', re.S)
MIN_CHARS = 200
COMMON_WORDS = re.compile(r"\b(the|a|an|of|to|is|and|in|for|this|that|be|with)\b", re.I)


def source_roots() -> list[Path]:
    """The standard library first, then every site-packages directory (deduplicated, existing)."""
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    roots = [stdlib]
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if p.is_dir() and p not in roots:
            roots.append(p)
    return roots


def python_files(root: Path, skip: list[Path]) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if here / d not in skip and d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield here / name


def looks_like_prose(text: str) -> bool:
    """English sentences rather than code, data or markup tables."""
    if len(text) < MIN_CHARS:
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    if letters < 0.8 * len(text):
        return False
    words = text.split()
    return len(words) >= 30 and len(COMMON_WORDS.findall(text)) >= 0.08 * len(words)


def docstrings(path: Path) -> Iterator[str]:
    try:
        data = path.read_bytes()
    except OSError:
        return
    for match in TRIPLE_QUOTED.finditer(data):
        raw = match.group(2)
        if len(raw) < MIN_CHARS:
            continue
        try:
            text = inspect.cleandoc(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        if looks_like_prose(text):
            yield text


def natural_documents(max_bytes: int) -> Iterator[str]:
    """Unique docstrings, in source order, until ``max_bytes`` of text have been produced."""
    roots = source_roots()
    seen: set[bytes] = set()
    produced = 0
    for i, root in enumerate(roots):
        # stdlib contains site-packages: read it once, as its own root, after the stdlib
        skip = [r for r in roots[i + 1:]]
        for path in python_files(root, skip):
            for text in docstrings(path):
                digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
                if digest in seen:
                    continue
                seen.add(digest)
                yield text
                produced += len(text.encode())
                if produced >= max_bytes:
                    return


def varied_documents(docs: list[str], pass_no: int) -> Iterator[str]:
    """Pass ``pass_no`` >= 1 over ``docs``: each document followed by the paragraphs of another,
    partners and paragraph order drawn from a generator seeded by the pass."""
    rng = random.Random(pass_no)
    partners = list(range(len(docs)))
    rng.shuffle(partners)
    for i, doc in enumerate(docs):
        other = docs[partners[i]].split("\n\n")
        rng.shuffle(other)
        yield doc + "\n\n" + "\n\n".join(other)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="JSONL file to write (parent directories are created).")
    parser.add_argument("--max-mb", type=float, default=8.0,
                        help="Stop reading sources after this many MB of text (default 8; 0 = read them all).")
    parser.add_argument("--min-mb", type=float, default=0.0,
                        help="Write at least this many MB, recombining documents in further passes if the sources hold less.")
    args = parser.parse_args(argv)

    mb = 1024 * 1024
    max_bytes = max(args.max_mb, args.min_mb) * mb if args.max_mb > 0 else float("inf")
    min_bytes = args.min_mb * mb
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = out_path.with_name(out_path.name + ".tmp")

    start = time.perf_counter()
    docs: list[str] = []
    written = 0
    with open(tmp_path, "w", encoding="utf-8") as out:
        def emit(text: str) -> None:
            nonlocal written
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            out.write(line)
            written += len(line.encode())

        for text in natural_documents(max_bytes):
            docs.append(text)
            emit(text)
        natural_docs = len(docs)
        pass_no = 0
        while written < min_bytes and docs:
            pass_no += 1
            for text in varied_documents(docs, pass_no):
                emit(text)
                if written >= min_bytes:
                    break
    os.replace(tmp_path, out_path)
    print(f"wrote {out_path}: {written / mb:.1f} MB, {natural_docs} docstrings"
          + (f" + {pass_no} recombined pass(es)" if pass_no else "")
          + f" in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
