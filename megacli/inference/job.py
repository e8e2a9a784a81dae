"""The generate job: prompts or texts from files, the generator run on every rank, results printed
and written by rank 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megacli.engine import distributed
from megacli.errors import UserError
from megacli.inference.generator import build_generator


def read_texts(path: str, key: str) -> list[str]:
    """JSONL (one object per line with `key`) or plain text (one item per line); errors name the line."""
    from megacli.data.jsonl import iter_lines

    items = []
    for where, item in iter_lines(path, plain_text=True):
        if isinstance(item, str):
            items.append(item)
        elif isinstance(item, dict) and isinstance(item.get(key), str):
            items.append(item[key])
        else:
            raise UserError(f"{where}: no string field {key!r}")
    return items


def chat_prompts(tokenizer_path: str | None, messages: list[str]) -> list[str]:
    """Each message as a user's turn rendered by the tokenizer's chat template, the assistant's turn started."""
    from megacli.data.sft import chat_template_of, render_chat

    template = chat_template_of(tokenizer_path)
    if template is None:
        raise UserError(f"generate.chat: the tokenizer ({tokenizer_path or 'none'}) has no chat template "
                        f"(chat_template in tokenizer_config.json, or chat_template.jinja); a model finetuned with "
                        f"sft.template carries its template in its checkpoint")
    return [render_chat([{"role": "user", "content": m}], template) for m in messages]


def run(recipe) -> None:
    with distributed.running(parallel=recipe.parallel, launch=recipe.launch, seed=recipe.generate.seed) as runtime:
        _run(recipe, runtime)


def _run(recipe, runtime) -> None:
    g = recipe.generate
    if recipe.model.arch == "t5" and (g.score or g.cloze):
        raise UserError("--score and --cloze are for GPT models (T5's likelihood depends on what the encoder is given)")
    speaker = runtime.rank == 0
    if g.score or g.cloze:
        texts = read_texts(g.score or g.cloze, "text")  # a bad file is refused before the model is built
        gen = build_generator(recipe, runtime)
        result = gen.score(texts) if g.score else gen.cloze(texts)
        if speaker:
            _report_scores(result, g)
        return
    prompts = list(g.prompts) + (read_texts(g.prompts_file, "prompt") if g.prompts_file else [])
    if not prompts:
        raise UserError("no prompts: give --prompt TEXT, --prompts FILE or generate.prompts")
    if g.chat:
        prompts = chat_prompts(recipe.tokenizer.path, prompts)
    gen = build_generator(recipe, runtime)
    tok = gen.tok
    out_file = open(g.output, "w", encoding="utf-8") if (g.output and speaker) else None
    try:
        for start in range(0, len(prompts), g.batch_size):
            batch = prompts[start : start + g.batch_size]
            stream = _Stream(tok, batch[0]) if (speaker and g.stream and len(batch) == 1 and g.num_beams == 1) else None
            results = gen.run_batch(batch, on_token=stream)
            if speaker:
                for r in results:
                    if stream is not None:
                        stream.finish(r.text)
                    else:
                        print(f"\n>>> {r.prompt}\n{r.text}", flush=True)
                    if out_file is not None:
                        record = {"prompt": r.prompt, "text": r.text, "tokens": r.tokens}
                        if r.logprobs is not None:
                            record["logprobs"] = r.logprobs
                        out_file.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if out_file is not None:
            out_file.close()


class _Stream:
    """Print a single prompt's text as its tokens arrive."""

    def __init__(self, tok, prompt: str):
        self.tok, self.shown = tok, ""
        print(f"\n>>> {prompt}", flush=True)

    def __call__(self, generated: list[list[int]]) -> None:
        text = self.tok.decode(generated[0])
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown) :])
            sys.stdout.flush()
            self.shown = text

    def finish(self, text: str) -> None:
        if not text.startswith(self.shown):
            sys.stdout.write("\n" + text)
        print(flush=True)


def _report_scores(result: dict, g) -> None:
    if "perplexity" in result:
        print(f"{result['texts']} texts, {result['tokens']} scored tokens: log-likelihood {result['logprob']:.4f}, "
              f"perplexity {result['perplexity']:.4f}", flush=True)
    else:
        print(f"cloze accuracy {result['accuracy']:.4f} ({result['correct']}/{result['texts']})", flush=True)
    if g.output:
        Path(g.output).write_text(json.dumps(result, indent=2) + "\n")
