"""Instruction data for finetuning: JSONL records -> token ids with a loss mask -> fixed-length
training samples (packed or padded).

A record is `{"prompt": ..., "response": ...}` or `{"messages": [{"role": ..., "content": ...}, ...]}`.
Only response (assistant) tokens carry loss. Packing puts several examples into one sequence;
each token then carries its example's index (`segments`), from which the engine builds a
block-diagonal causal mask, and its position restarts at 0 with each example, so a packed
example is computed exactly as it would be alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megacli.data.jsonl import iter_lines
from megacli.errors import UserError

@dataclass(frozen=True)
class ChatTemplate:
    source: str
    specials: dict


# The built-in templates as Jinja chat templates (Hugging Face's form): the text ``render`` gives a
# conversation, and with add_generation_prompt what starts the assistant's answer. A finetuned
# model's checkpoint carries the one it was trained with (megacli.checkpoint.carried).
JINJA_TEMPLATES = {
    "chatml": ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "plain": "{% for message in messages %}{{ message['content'] }}{% endfor %}",
}


def chat_template_of(tokenizer_path: str | None) -> ChatTemplate | None:
    """The chat template of the tokenizer at ``tokenizer_path`` (its directory, or the directory of
    the file it names), if it has one: chat_template.jinja, else tokenizer_config.json's
    chat_template (the order transformers reads them in)."""
    if not tokenizer_path:
        return None
    folder = Path(tokenizer_path).expanduser()
    folder = folder if folder.is_dir() else folder.parent
    config = folder / "tokenizer_config.json"
    import json

    settings = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    jinja = folder / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else settings.get("chat_template")
    if not isinstance(template, str):
        return None
    # Templates may name the special tokens (as transformers' apply_chat_template passes them).
    specials = {k: v for k, v in settings.items() if k in ("bos_token", "eos_token") and isinstance(v, str)}
    return ChatTemplate(template, specials)


def resolved_template(template: str, chat_template: ChatTemplate | None, field: str, tokenizer_path: str | None) -> str:
    """sft.template (or preference.template) as training uses it: auto is the tokenizer's chat
    template when it has one, else plain."""
    if template == "auto":
        return "tokenizer" if chat_template else "plain"
    if template == "tokenizer" and not chat_template:
        raise UserError(f"{field}: tokenizer, but {tokenizer_path} has no chat template (chat_template in "
                        f"tokenizer_config.json, or chat_template.jinja)")
    return template


def trained_chat_template(recipe) -> str | None:
    """The Jinja chat template a finetuning run trains with, for its checkpoints to carry: the
    built-in template it chose (None for the tokenizer's own, which the tokenizer files carry, and
    for pretraining)."""
    section, field = (recipe.sft, "sft.template") if recipe.sft is not None else (recipe.preference, "preference.template")
    if section is None:
        return None
    path = recipe.tokenizer.path
    return JINJA_TEMPLATES.get(resolved_template(section.template, chat_template_of(path), field, path))


def render_chat(messages: list[dict], chat_template: ChatTemplate, *, generation_prompt: bool = True) -> str:
    """A conversation as prompt text by a Jinja chat template (rendered by transformers in its sandbox)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template(conversations=[messages], chat_template=chat_template.source,
                                 add_generation_prompt=generation_prompt, **chat_template.specials)[0][0]


def render(record: dict, template: str, chat_template: ChatTemplate | None = None) -> list[tuple[str, bool]]:
    """The record as (text, carries loss) pieces, in order. template "tokenizer" renders with the
    tokenizer's Jinja chat template: each message is what rendering one more message adds."""
    if "messages" in record:
        messages = record["messages"]
    else:
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    pieces = []
    if template == "tokenizer":
        from transformers.utils.chat_template_utils import render_jinja_template

        done = ""
        for i, m in enumerate(messages):
            text = render_jinja_template(conversations=[messages[: i + 1]], chat_template=chat_template.source,
                                         **chat_template.specials)[0][0]
            if not text.startswith(done):
                raise UserError("the tokenizer's chat template does not render a conversation as a prefix of the "
                                "next one; use sft.template: chatml or plain")
            pieces.append((text[len(done):], m["role"] == "assistant"))
            done = text
        return pieces
    for m in messages:
        trained = m["role"] == "assistant"
        if template == "chatml":
            pieces += [(f"<|im_start|>{m['role']}\n", False), (m["content"] + "<|im_end|>\n", trained)]
        else:  # plain: the texts as they are, one after the other
            pieces.append((m["content"], trained))
    return pieces


def read_records(path: str) -> list[dict]:
    """Parse and check every line; a bad one is named by file and line."""
    records = []
    for where, record in iter_lines(path):
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object")
        if "messages" in record:
            msgs = record["messages"]
            if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                             and isinstance(m.get("content"), str) for m in msgs)):
                raise UserError(f"{where}: messages must be a list of {{role, content}} objects with string values")
            if not any(m["role"] == "assistant" for m in msgs):
                raise UserError(f"{where}: no assistant message (nothing to learn)")
        elif not (isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str)):
            raise UserError(f"{where}: expected string fields prompt and response, or messages")
        records.append(record)
    if not records:
        raise UserError(f"{path}: no records")
    return records


@dataclass
class Example:
    ids: list[int]
    trained: list[bool]  # per token: does predicting it carry loss


def tokenize(record: dict, tokenizer, template: str, chat_template: ChatTemplate | None = None) -> Example:
    ids, trained = [], []
    for text, carries in render(record, template, chat_template):
        piece = tokenizer.encode(text)
        ids += piece
        trained += [carries] * len(piece)
    if tokenizer.eod is not None:  # the end of the response is learned too
        ids.append(tokenizer.eod)
        trained.append(trained[-1] if trained else False)
    return Example(ids, trained)


@dataclass
class SftStats:
    examples: int = 0
    truncated: int = 0
    dropped: int = 0
    sequences: int = 0
    tokens: int = 0
    loss_tokens: int = 0

    def describe(self, name: str) -> str:
        frac = self.loss_tokens / self.tokens if self.tokens else 0.0
        return (f"{name}: {self.examples} examples -> {self.sequences} sequences; {self.loss_tokens} of {self.tokens} "
                f"tokens carry loss ({frac:.1%}); {self.truncated} truncated, {self.dropped} dropped as too long")


class SftDataset:
    """Fixed-length samples: tokens, labels, loss_mask, position_ids, segments (example index
    within the sequence, -1 on padding)."""

    def __init__(self, examples: list[Example], *, seq_length: int, pad_id: int, packing: bool, too_long: str,
                 stats: SftStats):
        self.seq_length = seq_length
        window = seq_length + 1  # inputs and labels are the same tokens shifted by one
        kept = []
        for ex in examples:
            if len(ex.ids) > window:
                if too_long == "drop":
                    stats.dropped += 1
                    continue
                stats.truncated += 1
                ex = Example(ex.ids[:window], ex.trained[:window])
            if not any(ex.trained[1:]):
                stats.dropped += 1  # nothing left to learn (its response was cut away)
                continue
            kept.append(ex)
        groups: list[list[Example]] = []
        for ex in kept:
            if packing and groups and sum(len(e.ids) for e in groups[-1]) + len(ex.ids) <= window:
                groups[-1].append(ex)
            else:
                groups.append([ex])
        self.samples = [self._sample(g, window, pad_id) for g in groups]
        stats.sequences += len(self.samples)
        for s in self.samples:
            stats.tokens += int((s["segments"] >= 0).sum())
            stats.loss_tokens += int(s["loss_mask"].sum())
        if not self.samples:
            raise UserError("no finetuning example is left (all dropped as too long?)")

    @staticmethod
    def _sample(group: list[Example], window: int, pad_id: int) -> dict:
        ids = np.full(window, pad_id, dtype=np.int64)
        trained = np.zeros(window, dtype=bool)
        segments = np.full(window, -1, dtype=np.int64)
        positions = np.zeros(window, dtype=np.int64)
        at = 0
        for i, ex in enumerate(group):
            n = len(ex.ids)
            ids[at : at + n] = ex.ids
            trained[at : at + n] = ex.trained
            segments[at : at + n] = i
            positions[at : at + n] = np.arange(n)
            at += n
        # Label t is token t+1; it carries loss when that token is trained and in the same example.
        same = (segments[1:] == segments[:-1]) & (segments[1:] >= 0)
        return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": (trained[1:] & same).astype(np.float32),
                "position_ids": positions[:-1], "segments": segments[:-1]}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]


def train_and_held_out(records: list, *, valid_records: list | None, fraction: float, seed: int) -> tuple[list, list]:
    """The training and validation records: ``valid_records`` when a validation file was given, else
    a seeded ``fraction`` of ``records`` (both keeping file order)."""
    if valid_records is not None:
        return records, valid_records
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_valid = int(round(len(records) * fraction))
    return [records[i] for i in sorted(order[n_valid:])], [records[i] for i in sorted(order[:n_valid])]


def build_sft_datasets(*, sft, tokenizer, tokenizer_path: str | None, seq_length: int,
                       seed: int) -> tuple[SftDataset, SftDataset | None, list[str]]:
    """Train and validation datasets (validation from sft.valid, or a seeded sft.valid_fraction of
    the training file) and one summary line per split."""
    records, valid_records = train_and_held_out(read_records(sft.train),
                                                valid_records=read_records(sft.valid_file) if sft.valid_file else None,
                                                fraction=sft.valid_fraction, seed=seed)
    out, lines = [], []
    for name, recs in (("train", records), ("validation", valid_records)):
        ds, line = _dataset(recs, name, sft=sft, tokenizer=tokenizer, tokenizer_path=tokenizer_path,
                            seq_length=seq_length) if recs else (None, None)
        out.append(ds)
        lines += [line] if line else []
    return out[0], out[1], lines


def build_sft_named_sets(*, sft, tokenizer, tokenizer_path: str | None,
                         seq_length: int) -> tuple[dict[str, SftDataset], list[str]]:
    """sft.valid as a map: name -> the dataset of its JSONL file (records in file order), and one
    summary line per set."""
    sets, lines = {}, []
    for name, path in sft.named_valid.items():
        sets[name], line = _dataset(read_records(path), f"validation set {name}", sft=sft, tokenizer=tokenizer,
                                    tokenizer_path=tokenizer_path, seq_length=seq_length)
        lines.append(line)
    return sets, lines


def _dataset(records: list[dict], name: str, *, sft, tokenizer, tokenizer_path: str | None,
             seq_length: int) -> tuple[SftDataset, str]:
    """The records as fixed-length samples, and a summary line."""
    if tokenizer.eod is None and tokenizer.pad is None:
        raise UserError("finetuning needs a tokenizer with an end-of-document token")
    chat_template = chat_template_of(tokenizer_path)
    template = resolved_template(sft.template, chat_template, "sft.template", tokenizer_path)
    pad_id = tokenizer.pad if tokenizer.pad is not None else tokenizer.eod
    stats = SftStats(examples=len(records))
    ds = SftDataset([tokenize(r, tokenizer, template, chat_template) for r in records], seq_length=seq_length,
                    pad_id=pad_id, packing=sft.packing, too_long=sft.too_long, stats=stats)
    return ds, stats.describe(name) + f" (template: {template})"
