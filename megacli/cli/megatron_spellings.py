"""Megatron-LM's tools/preprocess_data.py spellings for `megacli preprocess`: several values after
one ``--json-keys``, its tokenizer options (--tokenizer-type with --tokenizer-model, --vocab-file,
--merge-file), and a named refusal for each of its options megacli does not have."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megacli.errors import UserError

_NO_AUTOTUNE = "megacli does not search for a worker count; give --workers N (default: all cores)"
_NO_TIKTOKEN = "megacli has no TikTokenizer; give the tokenizer as a Hugging Face tokenizer.json (--tokenizer DIR)"
MEGATRON_ONLY = {
    "--find-optimal-num-workers": _NO_AUTOTUNE,
    "--workers-to-check": _NO_AUTOTUNE,
    "--max-documents": _NO_AUTOTUNE,
    "--performance-dir": _NO_AUTOTUNE,
    "--vocab-size": "it sizes Megatron-LM's NullTokenizer, and preprocessing needs a real tokenizer",
    "--vocab-extra-ids": "sentinel tokens are added at training time here (masking.sentinel_tokens), not by preprocessing",
    "--tiktoken-pattern": _NO_TIKTOKEN,
    "--tiktoken-num-special-tokens": _NO_TIKTOKEN,
    "--tiktoken-special-tokens": _NO_TIKTOKEN,
    "--dataset-impl": "megacli writes Megatron-Core's mmap indexed datasets only (the format Megatron-Core reads)",
}
# Those not in every Megatron-LM release megacli is checked against (core_v0.16.1, core_v0.19.0):
# the versions that have them (the refusal names them), and the checked minor releases that lack them.
OTHER_VERSIONS = {
    "--find-optimal-num-workers": ("after core_v0.16.1", ("0.16",)),
    "--workers-to-check": ("after core_v0.16.1", ("0.16",)),
    "--max-documents": ("after core_v0.16.1", ("0.16",)),
    "--performance-dir": ("after core_v0.19.0", ("0.16", "0.19")),
    "--tiktoken-special-tokens": ("before core_v0.19.0", ("0.19",)),
    "--dataset-impl": ("before core_v0.16.1", ("0.16", "0.19")),
}


def lacking_in(release: str) -> set[str]:
    """The refused options Megatron-LM ``release`` ("0.19.1") lacks, by OTHER_VERSIONS."""
    minor = ".".join(release.split(".")[:2])
    return {name for name, (_, lacking) in OTHER_VERSIONS.items() if minor in lacking}


# --tokenizer-type -> (megacli tokenizer.type, the Megatron-LM option that names its file).
MEGATRON_TOKENIZERS = {
    "HuggingFaceTokenizer": ("huggingface", "--tokenizer-model"),
    "GPTSentencePieceTokenizer": ("sentencepiece", "--tokenizer-model"),
    "Llama2Tokenizer": ("sentencepiece", "--tokenizer-model"),  # and a BOS before every document
    "BertWordPieceLowerCase": ("wordpiece", "--vocab-file"),
    "BertWordPieceCase": ("wordpiece", "--vocab-file"),
    "GPT2BPETokenizer": ("huggingface", "--vocab-file"),  # and --merge-file, beside a tokenizer.json
    "NullTokenizer": ("none", None),
}
NOT_THE_SAME = {
    "SentencePieceTokenizer": "it appends its own <CLS>/<SEP>/<EOD>/<MASK> tokens (eod is the added <EOD>); megacli's "
                              "sentencepiece is GPTSentencePieceTokenizer's (eod = the model's eos piece): use that, "
                              "or Llama2Tokenizer",
    "TikTokenizer": _NO_TIKTOKEN,
}


def _is_recipe(word: str) -> bool:
    return word.endswith((".yaml", ".yml"))


def translate_argv(args: list[str]) -> list[str]:
    """Megatron-LM's argv as megacli reads it: ``--json-keys a b`` -> ``--json-keys a --json-keys b``
    (the values end at the next option or a .yaml recipe); its options megacli lacks are refused."""
    out: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            return out + args[i:]
        name = word.split("=", 1)[0]
        if name in MEGATRON_ONLY:
            where = f" (in versions {OTHER_VERSIONS[name][0]})" if name in OTHER_VERSIONS else ""
            raise UserError(f"{name}: an option of Megatron-LM's preprocess_data.py{where} that megacli preprocess does "
                            f"not have: {MEGATRON_ONLY[name]}")
        i += 1
        if word != "--json-keys":
            out.append(word)
            continue
        values = []
        while i < len(args) and not args[i].startswith("-") and not _is_recipe(args[i]):
            values.append(args[i])
            i += 1
        out += [x for v in values for x in ("--json-keys", v)] if values else [word]
    return out


def megatron_tokenizer(tokenizer_type: Optional[str], *, model: Optional[str], vocab_file: Optional[str],
                       merge_file: Optional[str], split_sentences: bool) -> tuple[dict, dict]:
    """(tokenizer section, preprocess fields it implies) for Megatron-LM's tokenizer options."""
    from megacli.data.tokenizers import guess_tokenizer_type

    files = {"--tokenizer-model": model, "--vocab-file": vocab_file, "--merge-file": merge_file}
    if tokenizer_type is None:
        given = [(k, v) for k, v in files.items() if v]
        if len(given) != 1 or given[0][0] == "--merge-file":
            raise UserError("--merge-file needs --tokenizer-type GPT2BPETokenizer and --vocab-file" if merge_file else
                            f"{' and '.join(k for k, _ in given)}: say which tokenizer with --tokenizer-type")
        kind, path = guess_tokenizer_type(given[0][1])
        return {"type": kind, "path": path}, {}
    if tokenizer_type in NOT_THE_SAME:
        raise UserError(f"--tokenizer-type {tokenizer_type}: megacli does not tokenize as it does: {NOT_THE_SAME[tokenizer_type]}")
    if tokenizer_type not in MEGATRON_TOKENIZERS:
        raise UserError(f"--tokenizer-type {tokenizer_type}: expected one of {', '.join(MEGATRON_TOKENIZERS)} "
                        f"(or megacli's --tokenizer)")
    kind, file_option = MEGATRON_TOKENIZERS[tokenizer_type]
    wanted = {file_option} | ({"--merge-file"} if tokenizer_type == "GPT2BPETokenizer" else set())
    for option, value in files.items():
        if value and option not in wanted:
            raise UserError(f"{option}: --tokenizer-type {tokenizer_type} does not use it"
                            + (f" (its file is {file_option})" if file_option else ""))
        if not value and option in wanted:
            raise UserError(f"--tokenizer-type {tokenizer_type} needs {option}")
    path = files.get(file_option) if file_option else None
    extra: dict = {}
    if tokenizer_type == "GPT2BPETokenizer":
        path = _gpt2_directory(vocab_file, merge_file)
    elif tokenizer_type.startswith("BertWordPiece"):
        _check_casing(tokenizer_type, vocab_file)
    elif tokenizer_type == "Llama2Tokenizer":
        if split_sentences:
            raise UserError("--tokenizer-type Llama2Tokenizer with --split-sentences: Megatron-LM puts a BOS before "
                            "every sentence, megacli's --add-bos one before every document")
        extra["add_bos"] = True
    return {"type": kind, "path": path}, extra


def _gpt2_directory(vocab_file: str, merge_file: str) -> str:
    """GPT-2's vocab.json + merges.txt are read as the Hugging Face tokenizer.json beside them."""
    folder = Path(vocab_file).parent
    if Path(merge_file).parent != folder or not (folder / "tokenizer.json").is_file():
        raise UserError(f"--tokenizer-type GPT2BPETokenizer: megacli reads GPT-2's BPE from a Hugging Face "
                        f"tokenizer.json beside {vocab_file} and {merge_file} (a gpt2 tokenizer directory has all "
                        f"three); none there: give --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR")
    return str(folder)


def _check_casing(tokenizer_type: str, vocab_file: str) -> None:
    """megacli lower-cases exactly when the vocabulary is uncased; refuse the type that says otherwise."""
    from megacli.data.tokenizers import vocab_is_lower_case

    path = Path(vocab_file)
    if not path.is_file():
        raise UserError(f"--vocab-file {vocab_file}: no such file")
    lower = vocab_is_lower_case(line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    if lower != (tokenizer_type == "BertWordPieceLowerCase"):
        raise UserError(f"--tokenizer-type {tokenizer_type} with the {'uncased' if lower else 'cased'} vocabulary "
                        f"{vocab_file}: megacli lower-cases exactly when the vocabulary is uncased; use "
                        f"{'BertWordPieceLowerCase' if lower else 'BertWordPieceCase'}")
