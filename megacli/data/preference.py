"""Preference pairs for DPO-style finetuning: records in TRL's format -> token ids -> fixed-length
samples holding the chosen and the rejected sequence of each pair.

A record is ``{"prompt", "chosen", "rejected"}``, each a string, or each a list of chat messages
(``{"role", "content"}``: the prompt's conversation and the completion's messages). Tokenization
and truncation follow TRL's DPOTrainer:

* strings: prompt+completion is tokenized as one text and the end-of-document token appended;
  chats: the prompt is rendered with the generation prompt, prompt+completion without it;
* the completion starts where the prompt's ids and prompt+completion's ids first differ;
* ``max_prompt_length`` keeps a prompt's last tokens; ``max_length`` keeps the first tokens of
  prompt+completion, and a pair whose prompt alone fills it is dropped.

A sample holds [2, seq_length] arrays (row 0 chosen, row 1 rejected): tokens, labels (the next
token), loss_mask (1 where the label is a completion token) and position_ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megacli.data.jsonl import iter_lines
from megacli.data.sft import (JINJA_TEMPLATES, ChatTemplate, chat_template_of, render_chat, resolved_template,
                              train_and_held_out)
from megacli.errors import UserError

FIELDS = ("prompt", "chosen", "rejected")


def _is_messages(value) -> bool:
    return (isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value))


def check_record(where: str, record) -> dict:
    """The record if it is a well-formed pair; otherwise a UserError naming ``where``."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with prompt, chosen and rejected")
    missing = [k for k in FIELDS if k not in record]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)} (a pair is prompt, chosen, rejected)")
    kinds = {k: "text" if isinstance(record[k], str) else "messages" if _is_messages(record[k]) else None for k in FIELDS}
    bad = [k for k, kind in kinds.items() if kind is None]
    if bad:
        raise UserError(f"{where}: {', '.join(bad)} must be a string or a non-empty list of {{role, content}} "
                        f"messages with string values")
    if len(set(kinds.values())) > 1:
        raise UserError(f"{where}: prompt, chosen and rejected must all be strings or all be message lists")
    for k in FIELDS:
        value = record[k]
        empty = value == "" if kinds[k] == "text" else all(m["content"] == "" for m in value)
        if empty:
            what = "the first completion token would have no context" if k == "prompt" else "nothing to score"
            raise UserError(f"{where}: {k} is empty ({what})")
    return record


def read_pairs(path: str) -> list[tuple[str, dict]]:
    """(where, record) of every pair of a JSONL file or a local Hugging Face dataset directory
    (save_to_disk); a malformed record is named by file:line (dataset: path[row])."""
    if Path(path).is_dir():
        rows = _dataset_rows(path)
    else:
        rows = iter_lines(path)
    pairs = [(where, check_record(where, record)) for where, record in rows]
    if not pairs:
        raise UserError(f"{path}: no preference pairs")
    return pairs


def _dataset_rows(path: str):
    from datasets import Dataset, DatasetDict, load_from_disk

    try:
        ds = load_from_disk(path)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(f"{path}: not a Hugging Face dataset saved with save_to_disk ({exc})") from None
    if isinstance(ds, DatasetDict):
        if len(ds) != 1:
            raise UserError(f"{path}: a dataset with several splits ({', '.join(ds)}); name the split's directory")
        ds = next(iter(ds.values()))
    assert isinstance(ds, Dataset)
    for i, row in enumerate(ds):
        yield f"{path}[row {i}]", row


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def _render(messages: list[dict], template: str, chat_template: ChatTemplate | None, *, generation_prompt: bool) -> str:
    if template != "tokenizer":
        chat_template = ChatTemplate(JINJA_TEMPLATES[template], {})
    return render_chat(messages, chat_template, generation_prompt=generation_prompt)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(record: dict, tokenizer, template: str, chat_template: ChatTemplate | None = None) -> Pair:
    """Prompt, chosen and rejected ids as TRL's DPOTrainer tokenizes them."""
    if isinstance(record["prompt"], str):
        prompt = tokenizer.encode(record["prompt"])
        full = [tokenizer.encode(record["prompt"] + record[k]) + [tokenizer.eod] for k in ("chosen", "rejected")]
    else:
        prompt = tokenizer.encode(_render(record["prompt"], template, chat_template, generation_prompt=True))
        full = [tokenizer.encode(_render(record["prompt"] + record[k], template, chat_template, generation_prompt=False))
                for k in ("chosen", "rejected")]
    n = min(_common_prefix(prompt, full[0]), _common_prefix(prompt, full[1]))
    return Pair(prompt[:n], full[0][n:], full[1][n:])


@dataclass
class PreferenceStats:
    pairs: int = 0
    dropped: int = 0  # the prompt alone fills max_length
    truncated: int = 0  # prompt + completion cut at max_length
    prompts_truncated: int = 0  # prompt cut to max_prompt_length
    tokens: int = 0
    completion_tokens: int = 0
    dropped_where: list[str] = field(default_factory=list)

    def describe(self, name: str) -> str:
        kept = self.pairs - self.dropped
        return (f"{name}: {self.pairs} pairs -> {kept} kept; {self.completion_tokens} of {self.tokens} tokens scored; "
                f"{self.prompts_truncated} prompts truncated (max_prompt_length), {self.truncated} pairs truncated and "
                f"{self.dropped} dropped (max_length)")


class PreferenceDataset:
    """Fixed-length pair samples (see the module's docstring); ``ref_logps`` [pairs, 2], once set,
    gives each sample the reference model's summed log-probabilities of its chosen and rejected
    completions."""

    def __init__(self, pairs: list[tuple[str, Pair]], *, seq_length: int, pad_id: int, max_length: int,
                 max_prompt_length: int | None, stats: PreferenceStats):
        self.seq_length = seq_length
        window = seq_length + 1
        if max_length > window:
            raise UserError(f"preference.max_length = {max_length} exceeds model.seq_length + 1 = {window}")
        rows = []
        for where, pair in pairs:
            prompt = pair.prompt
            if max_prompt_length is not None and len(prompt) > max_prompt_length:
                prompt = prompt[-max_prompt_length:]
                stats.prompts_truncated += 1
            if len(prompt) >= max_length:
                stats.dropped += 1
                stats.dropped_where.append(where)
                continue
            seqs = [prompt + pair.chosen, prompt + pair.rejected]
            if max(len(s) for s in seqs) > max_length:
                stats.truncated += 1
            rows.append(np.stack([self._row(s[:max_length], len(prompt), window, pad_id) for s in seqs]))
        if not rows:
            raise UserError("no preference pair is left (every prompt fills preference.max_length)")
        self.samples = np.stack(rows)  # [pairs, 2 (chosen, rejected), 2 (ids, scored), window]
        stats.tokens += int((self.samples[:, :, 1] >= 0).sum())
        stats.completion_tokens += int((self.samples[:, :, 1] == 1).sum())
        self.ref_logps: np.ndarray | None = None

    @staticmethod
    def _row(ids: list[int], prompt_len: int, window: int, pad_id: int) -> np.ndarray:
        """[ids padded to the window; 0 prompt / 1 completion / -1 padding]."""
        row = np.full((2, window), -1, dtype=np.int64)
        row[0] = pad_id
        row[0, :len(ids)] = ids
        row[1, :len(ids)] = 0
        row[1, prompt_len:len(ids)] = 1
        return row

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        ids, kind = self.samples[i, :, 0], self.samples[i, :, 1]
        sample = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": (kind[:, 1:] == 1).astype(np.float32),
                  "position_ids": np.tile(np.arange(self.seq_length), (2, 1))}
        if self.ref_logps is not None:
            sample["ref_logps"] = self.ref_logps[i]
        return sample


def _dataset(pairs: list[tuple[str, dict]], name: str, *, pref, tokenizer, tokenizer_path: str | None,
             seq_length: int) -> tuple[PreferenceDataset, str]:
    if tokenizer.eod is None:
        raise UserError("preference tuning needs a tokenizer with an end-of-document token")
    chat_template = chat_template_of(tokenizer_path)
    template = resolved_template(pref.template, chat_template, "preference.template", tokenizer_path)
    stats = PreferenceStats(pairs=len(pairs))
    tokenized = [(where, tokenize_pair(r, tokenizer, template, chat_template)) for where, r in pairs]
    for where, pair in tokenized:
        for k in ("chosen", "rejected"):
            if not getattr(pair, k):
                raise UserError(f"{where}: {k} adds no tokens after the prompt (an empty completion)")
    pad_id = tokenizer.pad if tokenizer.pad is not None else tokenizer.eod
    ds = PreferenceDataset(tokenized, seq_length=seq_length, pad_id=pad_id,
                           max_length=pref.max_length or seq_length + 1, max_prompt_length=pref.max_prompt_length,
                           stats=stats)
    ds.name = name
    return ds, stats.describe(name) + f" (template: {template})"


def build_preference_datasets(*, pref, tokenizer, tokenizer_path: str | None, seq_length: int,
                              seed: int) -> tuple[PreferenceDataset, PreferenceDataset | None, list[str]]:
    """Train and validation datasets (validation from preference.valid as one file, or a seeded
    valid_fraction of the training pairs) and one summary line per split."""
    pairs, valid_pairs = train_and_held_out(read_pairs(pref.train),
                                            valid_records=read_pairs(pref.valid_file) if pref.valid_file else None,
                                            fraction=pref.valid_fraction, seed=seed)
    out, lines = [], []
    for name, recs in (("train", pairs), ("validation", valid_pairs)):
        ds, line = _dataset(recs, name, pref=pref, tokenizer=tokenizer, tokenizer_path=tokenizer_path,
                            seq_length=seq_length) if recs else (None, None)
        out.append(ds)
        lines += [line] if line else []
    return out[0], out[1], lines


def build_preference_named_sets(*, pref, tokenizer, tokenizer_path: str | None,
                                seq_length: int) -> tuple[dict[str, PreferenceDataset], list[str]]:
    """preference.valid as a map: name -> the dataset of its pairs (in file order), and a summary line each."""
    sets, lines = {}, []
    for name, path in pref.named_valid.items():
        sets[name], line = _dataset(read_pairs(path), f"validation set {name}", pref=pref, tokenizer=tokenizer,
                                    tokenizer_path=tokenizer_path, seq_length=seq_length)
        lines.append(line)
    return sets, lines
