"""A Hugging Face ``tokenizers`` fast tokenizer (tokenizer.json) with the special tokens of its
tokenizer_config.json, as Megatron-LM's HuggingFaceTokenizer gives ids: ``AutoTokenizer.tokenize``
+ ``convert_tokens_to_ids``, no special tokens added. A plain GPT-2-style byte-level BPE encodes
ASCII text through a faster, id-identical shortcut (``_AsciiByteLevel``)."""

from __future__ import annotations

import json
import os
from itertools import chain
from pathlib import Path
from typing import Iterable, Optional

from megacli.data.tokenizer_base import Tokenizer
from megacli.errors import UserError
from megacli.paths import shown


def _token_content(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HuggingFaceTokenizer(Tokenizer):
    """A ``tokenizers`` fast tokenizer (tokenizer.json) with the special tokens of its
    tokenizer_config.json / special_tokens_map.json."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        root = Path(path)
        file = root / "tokenizer.json" if root.is_dir() else root
        config_dir = root if root.is_dir() else root.parent
        if not file.is_file():
            raise UserError(f"tokenizer.path = {shown(path)}: no tokenizer.json there (a Hugging Face tokenizer "
                            "directory saved by save_pretrained, or the tokenizer.json file itself)")
        try:
            self._tok = RustTokenizer.from_file(str(file))
        except Exception as exc:
            raise UserError(f"tokenizer.path = {shown(path)}: cannot read {file}: {exc}") from None
        self.file = file
        # Documents are never cut or padded, whatever tokenizer.json says (as AutoTokenizer.tokenize).
        self._tok.no_truncation()
        self._tok.no_padding()
        self.name = str(path)
        specials = _special_tokens(config_dir)
        token_id = self._tok.token_to_id
        ids = {k: (token_id(v) if v is not None else None) for k, v in specials.items()}
        eos = ids.get("eos_token") if ids.get("eos_token") is not None else ids.get("sep_token")
        if eos is None:
            raise UserError(f"tokenizer {path!r} has no eos_token (or sep_token) to end documents with; "
                            "set eos_token in its tokenizer_config.json")
        self.eod = eos
        self.bos = ids.get("bos_token") if ids.get("bos_token") is not None else ids.get("cls_token")
        self.cls = ids.get("cls_token") if ids.get("cls_token") is not None else ids.get("bos_token")
        self.sep = ids.get("sep_token") if ids.get("sep_token") is not None else ids.get("eos_token")
        self.pad = ids.get("pad_token")
        self.mask = ids.get("mask_token")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._fast = _AsciiByteLevel.for_tokenizer(self._tok, file)

    @property
    def shortcut(self) -> Optional[str]:
        """The faster encoder used beside the tokenizers library's, if any (for --dry-run)."""
        return None if self._fast is None else "ASCII byte-level BPE shortcut (same ids)"

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is None:
            return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]
        out: list = [self._fast.encode(t) for t in texts]
        rest = [i for i, ids in enumerate(out) if ids is None]
        if rest:
            for i, e in zip(rest, self._tok.encode_batch_fast([texts[i] for i in rest], add_special_tokens=False)):
                out[i] = e.ids
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def vocabulary(self) -> dict[int, str]:
        return {i: t for t, i in self._tok.get_vocab(with_added_tokens=True).items()}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class _AsciiByteLevel:
    """Same ids as the Rust pipeline, several times faster, for ASCII text and a plain GPT-2-style
    byte-level BPE (no normalizer, ByteLevel pre-tokenizer with its default regex and no prefix
    space). Rust's pre-tokenizer regex is the slow part there; on ASCII its classes are exact
    ASCII sets (letters, digits, the six ASCII white-space characters), so Python's ``re``
    splits identically, and each distinct word goes through the Rust BPE model once (cached).
    Texts that are not ASCII or that contain an added token return None: the caller uses Rust."""

    _WS = r"\t\n\x0b\x0c\r "
    PATTERN = (rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+"
               rf"|[{_WS}]+(?![^{_WS}])|[{_WS}]+")
    MAX_CACHE = 1 << 20  # distinct words kept; the cache is cleared when it grows past this

    def __init__(self, rust_tokenizer) -> None:
        import re

        self._tok = rust_tokenizer
        self._split = re.compile(self.PATTERN).findall
        self._to_unicode = str.maketrans({chr(b): c for b, c in _bytes_to_unicode().items() if b < 128})
        self._added = [t.content for t in rust_tokenizer.get_added_tokens_decoder().values()]
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def for_tokenizer(cls, rust_tokenizer, file: Path) -> "Optional[_AsciiByteLevel]":
        if os.environ.get("MEGACLI_NO_FAST_BPE"):
            return None
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        pre, model = config.get("pre_tokenizer") or {}, config.get("model") or {}
        plain = (config.get("normalizer") is None
                 and pre.get("type") == "ByteLevel" and pre.get("add_prefix_space") is False
                 and pre.get("use_regex", True) is True
                 and model.get("type") == "BPE" and model.get("dropout") is None)
        return cls(rust_tokenizer) if plain else None

    def encode(self, text: str) -> Optional[list[int]]:
        if not text.isascii() or any(a in text for a in self._added):
            return None
        words = self._split(text)
        cache = self._cache
        try:
            return list(chain.from_iterable(map(cache.__getitem__, words)))
        except KeyError:
            if len(cache) > self.MAX_CACHE:
                cache.clear()
            model = self._tok.model
            for w in words:
                if w not in cache:
                    cache[w] = [t.id for t in model.tokenize(w.translate(self._to_unicode))]
            return list(chain.from_iterable(map(cache.__getitem__, words)))

    def __getstate__(self):
        return {"tok": self._tok}

    def __setstate__(self, state) -> None:
        self.__init__(state["tok"])


def _special_tokens(config_dir: Path) -> dict[str, Optional[str]]:
    """eos/bos/... token strings, tokenizer_config.json first, then special_tokens_map.json."""
    names = ("eos_token", "bos_token", "sep_token", "cls_token", "pad_token", "mask_token", "unk_token")
    found: dict[str, Optional[str]] = {n: None for n in names}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):
        f = config_dir / fname
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {f}: {exc}") from None
        for n in names:
            if _token_content(data.get(n)) is not None:
                found[n] = _token_content(data.get(n))
    return found
