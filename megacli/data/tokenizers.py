"""Tokenizers shared by preprocessing and training: one small interface over Hugging Face
``tokenizers``, SentencePiece, BERT WordPiece vocab files, raw bytes and pre-tokenized ids.

    tok = load_tokenizer(type="huggingface", path="data/tokenizer")
    tok.encode("Hello") -> [...];  tok.encode_batch([...]);  tok.decode(ids)
    tok.vocab_size, tok.eod, tok.bos, tok.pad, tok.cls, tok.sep, tok.mask

Ids and special tokens follow Megatron-LM's tokenizers so that a dataset built here is the one
Megatron-LM's ``tools/preprocess_data.py`` builds:

* huggingface: ids as ``AutoTokenizer.tokenize`` + ``convert_tokens_to_ids`` give them (no
  special tokens added); eod = eos_token (else sep_token); bos = bos_token (else cls_token);
  vocab_size counts added tokens.
* sentencepiece: ``encode_as_ids``; eod = the model's eos piece, bos its bos piece.
* wordpiece: Megatron's ``BertWordPieceLowerCase``/``BertWordPieceCase`` (legacy tokenizer):
  lower-casing is chosen from the vocabulary (no upper-case token -> lower-case), ``[BOS]`` and
  ``[EOS]`` are appended to the vocabulary when absent, eod = ``[EOS]``.
* byte: no files. Ids 0..255 are the UTF-8 bytes; then the specials
  256 ``<eod>``, 257 ``<bos>``, 258 ``<pad>``, 259 ``<cls>``, 260 ``<sep>``, 261 ``<mask>``;
  vocab_size 262.
* none: text is whitespace-separated ids below ``vocab_size``; eod = vocab_size, so the
  vocabulary holds vocab_size + 1 ids (as Megatron-LM's NullTokenizer). A recipe's
  model.vocab_size counts them all: ``load_tokenizer`` builds ``NullTokenizer(model.vocab_size - 1)``.

Every tokenizer pickles, so worker processes can receive it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional, Sequence

from megacli.data.hf_tokenizer import HuggingFaceTokenizer
from megacli.data.tokenizer_base import Tokenizer
from megacli.errors import UserError
from megacli.paths import shown

TOKENIZER_TYPES = ("huggingface", "byte", "sentencepiece", "wordpiece", "none")


SENTINEL = "<extra_id_{}>"  # T5 sentinel tokens, appended to a vocabulary that lacks them (Megatron's vocab_extra_ids)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then the special tokens in SPECIALS order."""

    SPECIALS = ("<eod>", "<bos>", "<pad>", "<cls>", "<sep>", "<mask>")

    def __init__(self) -> None:
        self.name = "byte"
        self.eod, self.bos, self.pad, self.cls, self.sep, self.mask = range(256, 256 + len(self.SPECIALS))
        self.vocab_size = 256 + len(self.SPECIALS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogatepass"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8", "surrogatepass")) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", "replace"))
            run.clear()
            special = i - 256
            out.append(self.SPECIALS[special] if 0 <= special < len(self.SPECIALS) else f"<{i}>")
        out.append(run.decode("utf-8", "replace"))
        return "".join(out)

    def vocabulary(self) -> dict[int, str]:
        vocab = {i: bytes([i]).decode("latin-1") for i in range(256)}
        vocab.update({256 + k: tok for k, tok in enumerate(self.SPECIALS)})
        return vocab


class NullTokenizer(Tokenizer):
    """Text that already is ids: ``"5 17 3"`` -> [5, 17, 3]."""

    def __init__(self, vocab_size: int) -> None:
        self.name = f"null({vocab_size})"
        self.eod = vocab_size
        self.vocab_size = vocab_size + 1

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        out = []
        for text in texts:
            ids = [int(tok) for tok in text.split()]
            if any(not 0 <= i < self.vocab_size for i in ids):
                raise ValueError(f"id outside 0..{self.vocab_size - 1} in {text[:80]!r}")
            out.append(ids)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def vocabulary(self) -> dict[int, str]:
        return {**{i: str(i) for i in range(self.eod)}, self.eod: "<eod>"}


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model``: ``encode_as_ids`` ids, eod = eos piece, bos = bos piece."""

    def __init__(self, path: str) -> None:
        import sentencepiece

        if not Path(path).is_file():
            raise UserError(f"tokenizer.path = {shown(path)}: no such SentencePiece model file")
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except Exception as exc:
            raise UserError(f"tokenizer.path = {shown(path)}: not a SentencePiece model ({exc})") from None
        self.name = str(path)
        self.file = Path(path)

        def opt(i: int) -> Optional[int]:
            return i if i >= 0 else None

        eos = opt(self._sp.eos_id())
        if eos is None:
            raise UserError(f"SentencePiece model {path!r} has no eos piece to end documents with")
        self.eod = eos
        self.bos = opt(self._sp.bos_id())
        self.pad = opt(self._sp.pad_id())
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode_as_ids(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode_ids([int(i) for i in ids])

    def vocabulary(self) -> dict[int, str]:
        return {i: self._sp.id_to_piece(i) for i in range(self.vocab_size)}


def vocab_is_lower_case(tokens: Iterable[str]) -> bool:
    """A WordPiece vocabulary is uncased when no token but the [SPECIAL] ones has an upper-case letter."""
    return not any(any(c.isupper() for c in tok) for tok in tokens if not (tok.startswith("[") and tok.endswith("]")))


class WordPieceTokenizer(Tokenizer):
    """BERT WordPiece from a vocab.txt, tokenizing as Megatron-LM's legacy BertWordPiece tokenizers
    (the original BERT basic + wordpiece tokenizer, here run by the Rust implementation)."""

    def __init__(self, path: str, lower_case: Optional[bool] = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers

        file = Path(path)
        if file.is_dir():
            file = file / "vocab.txt"
        if not file.is_file():
            raise UserError(f"tokenizer.path = {shown(path)}: no WordPiece vocab.txt there")
        vocab: dict[str, int] = {}
        # As BERT's load_vocab: one token a line, stripped; a repeated token keeps its last line.
        with open(file, encoding="utf-8") as f:
            for index, line in enumerate(f):
                vocab[line.strip()] = index
        if "[UNK]" not in vocab:
            raise UserError(f"WordPiece vocab {file} has no [UNK] token")
        if lower_case is None:
            lower_case = vocab_is_lower_case(vocab)
        self.lower_case = lower_case
        self.name = f"{file} ({'lower' if lower_case else 'cased'})"
        # Megatron counts len(vocab) (a dict), then appends [BOS] and [EOS] when they are missing.
        size = len(vocab)
        self._extra: dict[int, str] = {}
        full = dict(vocab)
        for tok in ("[BOS]", "[EOS]"):
            if tok not in full:
                full[tok] = size
                self._extra[size] = tok
                size += 1
        self.vocab_size = size
        self.bos, self.eod = full["[BOS]"], full["[EOS]"]
        self.cls, self.sep = vocab.get("[CLS]"), vocab.get("[SEP]")
        self.pad, self.mask = vocab.get("[PAD]"), vocab.get("[MASK]")

        self._tok = RustTokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=200))
        self._tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case)
        self._tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._decoder = decoders.WordPiece()
        self._id_to_token = {i: t for t, i in full.items()}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._decoder.decode([self._id_to_token.get(int(i), "[UNK]") for i in ids])

    def vocabulary(self) -> dict[int, str]:
        return dict(self._id_to_token)


def load_tokenizer(*, type: str, path: str | None, vocab_size: int | None = None) -> Tokenizer:
    """Build the tokenizer a ``tokenizer:`` recipe section names (``vocab_size``, for none only: the
    model's vocabulary, end-of-document id included)."""
    if type == "byte":
        return ByteTokenizer()
    if type == "none":
        if not vocab_size or vocab_size < 2:
            raise UserError("tokenizer type none needs a vocabulary size of at least 2 (model.vocab_size)")
        # model.vocab_size is the embedding's rows: the ids and the end-of-document id after them
        # (Megatron-LM's --vocab-size is the ids alone: the checkpoint readers add the 1).
        return NullTokenizer(vocab_size - 1)
    if type not in TOKENIZER_TYPES:
        raise UserError(f"tokenizer.type = {type!r}: expected one of {', '.join(TOKENIZER_TYPES)}")
    if not path:
        raise UserError(f"tokenizer type {type!r} needs tokenizer.path")
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise UserError(f"tokenizer.path = {shown(path)}: no such file or directory")
    if type == "huggingface":
        return HuggingFaceTokenizer(path)
    if type == "sentencepiece":
        return SentencePieceTokenizer(path)
    return WordPieceTokenizer(path)


def guess_tokenizer_type(spec: str) -> tuple[str, Optional[str]]:
    """``--tokenizer`` one-off value -> (type, path): ``byte``, a HF directory or tokenizer.json,
    a SentencePiece ``.model`` or a WordPiece ``.txt`` vocabulary."""
    if spec in ("byte", "none", "null"):  # null: the old spelling of none
        return ("none" if spec == "null" else spec), None
    p = Path(spec)
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return "huggingface", spec
        if (p / "vocab.txt").is_file():
            return "wordpiece", spec
        models = sorted(p.glob("*.model"))
        if len(models) == 1:
            return "sentencepiece", str(models[0])
        return "huggingface", spec
    if p.suffix == ".model":
        return "sentencepiece", spec
    if p.suffix == ".txt":
        return "wordpiece", spec
    return "huggingface", spec


def describe_specials(tok: Tokenizer) -> str:
    parts = [f"{name}={getattr(tok, name)}" for name in ("eod", "bos", "pad", "cls", "sep", "mask")
             if getattr(tok, name, None) is not None]
    return ", ".join(parts)


__all__: Sequence[str] = ("Tokenizer", "load_tokenizer", "guess_tokenizer_type", "TOKENIZER_TYPES")
