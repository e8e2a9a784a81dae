"""gigatoken behind the ``Tokenizer`` interface, used only where it gives the reference ids.

    tokenizer, note = accelerate(tokenizer, lambda: first_documents_of_the_corpus)

gigatoken (PyPI) encodes byte-level BPE tokenizer.json files and SentencePiece BPE models with
byte fallback many times faster than ``tokenizers`` and ``sentencepiece``. ``accelerate`` loads
it for the tokenizer and encodes a sample (the corpus's first documents, read only when gigatoken
may serve) plus fixed hard cases both ways; only when every id agrees does it return a
``GigatokenTokenizer``. Otherwise, and where gigatoken is not installed, cannot read the
tokenizer or is switched off (``MEGACLI_NO_GIGATOKEN=1``), the reference tokenizer comes back
with a one-line ``note`` saying why. WordPiece, byte and pre-tokenized (none) tokenizers are not
gigatoken's: they come back as they are, with no note.

One difference is known and handled per text: SentencePiece reads a control piece written in
the text (``</s>``) as plain characters, gigatoken as the token; texts holding a special token
that the two encode differently go to the reference tokenizer.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import numpy as np

from megacli.data.hf_tokenizer import HuggingFaceTokenizer
from megacli.data.tokenizer_base import Tokenizer
from megacli.data.tokenizers import SentencePieceTokenizer

OFF_SWITCH = "MEGACLI_NO_GIGATOKEN"

# Cases where BPE implementations tend to part ways: white-space runs and kinds, contractions,
# digits, punctuation runs, accents (composed and combining), scripts without spaces, emoji,
# control characters, ends of text.
PROBES = (
    "", " ", "  ", "\n", "\r\n", "\t", " \t\n \u00a0x", "a  b   c\t\td\n\n\ne ", "  leading", "trailing  ",
    "It's 2024, we've 3.5M reasons; don't WON'T they'll I'm you're 'quoted'.",
    "1234567890 3.14159 1,000,000 0x1F 1e-9 ½ ² ٣",
    "!!! ??? ... --- ((( ))) {{}} [[]] <<>> @@## $$%% ^^&& **__ ++== ||\\\\ ~~``",
    "Naïve café, crème brûlée, Ångström, Zürich; nai\u0308ve cafe\u0301",
    "日本語のテキスト、中文文本，한국어 텍스트. Ελληνικά, русский, עברית, العربية, हिन्दी.",
    "🚀 👩‍💻 🇩🇪 ✓ ∑ ∫ → ≠ ﬁ ﬂ ① Ⅻ",
    "\x00\x01\x1b[0m\x7f\u200b\u200d\ufeff end",
    "def f(x):\n    return x ** 2  # comment\n\tif x: pass\n",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html> {\"json\": [1, 2]}",
    "a" * 300, " " * 300, "ab" * 150 + "\n" * 20,
)


class GigatokenTokenizer(Tokenizer):
    """A reference tokenizer's ids, specials and decoding, with gigatoken doing the encoding."""

    def __init__(self, reference: Tokenizer, defer: tuple[str, ...] = (), engine=None) -> None:
        self.reference = reference
        for name in ("vocab_size", "eod", "bos", "pad", "cls", "sep", "mask", "name"):
            setattr(self, name, getattr(reference, name))
        self.defer = defer  # texts holding one of these are encoded by the reference tokenizer
        self._engine = engine if engine is not None else _load_engine(reference)
        import awkward  # noqa: F401  (gigatoken's batch results; imported once here, before workers fork)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Sequential: this is the small-batch call (the identity check runs it before workers are
        # forked, and a thread pool started then would be unusable in them).
        ids = self._engine.encode_batch_list(texts, parallel=False)
        for i in self._deferred(texts):
            ids[i] = self.reference.encode(texts[i])
        return ids

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        import awkward as ak

        # parallel=None: gigatoken's threads in the main process, one thread in a worker process
        encoded = self._engine.encode_batch(texts, parallel=None)
        tokens, lengths = ak.to_numpy(ak.flatten(encoded)), ak.to_numpy(ak.num(encoded))
        deferred = self._deferred(texts)
        if deferred:
            rows = np.split(tokens, np.cumsum(lengths)[:-1])
            for i in deferred:
                rows[i] = np.asarray(self.reference.encode(texts[i]), tokens.dtype)
            tokens, lengths = np.concatenate(rows), np.fromiter(map(len, rows), np.int64, len(rows))
        return tokens, lengths

    def _deferred(self, texts: list[str]) -> list[int]:
        if not self.defer:
            return []
        return [i for i, text in enumerate(texts) if any(s in text for s in self.defer)]

    def decode(self, ids) -> str:
        return self.reference.decode(ids)

    def vocabulary(self) -> dict[int, str]:
        return self.reference.vocabulary()

    def __repr__(self) -> str:
        # The reference's: the ids are the same, so partitions written by either path stay valid.
        return repr(self.reference)

    def __getstate__(self) -> dict:
        return {"reference": self.reference, "defer": self.defer}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["reference"], state["defer"])


def _load_engine(reference: Tokenizer):
    import gigatoken

    if isinstance(reference, HuggingFaceTokenizer):
        return gigatoken.Tokenizer.from_json(reference.file.read_bytes())
    return gigatoken.Tokenizer.from_sentencepiece(reference.file)


def _special_texts(reference: Tokenizer) -> list[str]:
    """The texts of the tokenizer's added tokens (Hugging Face) or control pieces (SentencePiece)."""
    if isinstance(reference, HuggingFaceTokenizer):
        config = json.loads(reference.file.read_text(encoding="utf-8"))
        return [t["content"] for t in config.get("added_tokens") or []]
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(reference.file))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i)]


def accelerate(tokenizer: Tokenizer, sample: Callable[[], list[str]]) -> tuple[Tokenizer, Optional[str]]:
    """(gigatoken in front of ``tokenizer`` if it gives the same ids on the texts ``sample()``
    returns and on PROBES, else ``tokenizer``; a one-line note when gigatoken could have served
    but does not)."""
    if type(tokenizer) not in (HuggingFaceTokenizer, SentencePieceTokenizer):
        return tokenizer, None
    library = reference_library(tokenizer)
    if os.environ.get(OFF_SWITCH, "") not in ("", "0"):
        return tokenizer, f"{OFF_SWITCH} is set: tokenizing with {library}, not gigatoken"
    try:
        import gigatoken  # noqa: F401
    except ImportError:
        return tokenizer, f"gigatoken is not installed (pip install gigatoken): tokenizing with {library}, several times slower"
    try:
        engine = _load_engine(tokenizer)
        specials = _special_texts(tokenizer)
    except Exception as exc:  # gigatoken names what it does not support; its messages carry a Rust location
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return tokenizer, f"gigatoken cannot use this tokenizer ({reason}): tokenizing with {library}"
    defer = tuple(s for s in specials if s and tokenizer.encode(s) != engine.encode(s).tolist())
    fast = GigatokenTokenizer(tokenizer, defer, engine)
    texts = [*PROBES, *(f"x{s}y {s}" for s in specials), *sample()]
    expected, got = tokenizer.encode_batch(texts), fast.encode_batch(texts)
    differ = [i for i, (a, b) in enumerate(zip(expected, got)) if list(a) != list(b)]
    if differ:
        first = texts[differ[0]]
        return tokenizer, (f"gigatoken gives other ids than {library} on {len(differ)} of {len(texts)} sample texts "
                           f"(first: {first[:40]!r}{'...' if len(first) > 40 else ''}): tokenizing with {library}")
    return fast, None


def reference_library(tokenizer: Tokenizer) -> str:
    return "sentencepiece" if isinstance(tokenizer, SentencePieceTokenizer) else "the tokenizers library"


def describe_encoder(tokenizer: Tokenizer) -> str:
    """Which code turns text into ids, for the summary and --dry-run."""
    if isinstance(tokenizer, GigatokenTokenizer):
        from importlib.metadata import version

        return f"gigatoken {version('gigatoken')} (same ids as {reference_library(tokenizer.reference)}, checked on load)"
    if isinstance(tokenizer, SentencePieceTokenizer):
        return "sentencepiece"
    if isinstance(tokenizer, HuggingFaceTokenizer):
        return "the tokenizers library" + (f" + {tokenizer.shortcut}" if tokenizer.shortcut else "")
    return f"megacli's {type(tokenizer).__name__}"
