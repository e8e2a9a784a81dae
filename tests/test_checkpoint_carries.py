"""A checkpoint carries what it needs: the tokenizer it was trained with and the chat template a
finetuned model was trained with (CKPT/hf, named ../hf by each iteration's recipe.yaml), so that
every command reading it works with the checkpoint moved elsewhere and run from a third
directory; the template renders the ids training rendered, in serve, generate --chat and the
Hugging Face export; and the logged learning rate is the rate its step used.

One tiny GPT with a byte-level BPE tokenizer is pretrained (4 steps, warmup) and finetuned on
chats (chatml, 2 steps) once, from a training directory with relative paths; then the finetuned
checkpoint is moved and the training directory's tokenizer removed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import MOCK_GPT, layout, megacli_here, ok, records, sets_args, warm_call

CHAT = [{"role": "user", "content": "the quick brown"}, {"role": "assistant", "content": "fox jumps"}]
LR, WARMUP, ITERS = 1e-2, 2, 4
TINY = [*MOCK_GPT, *layout(), "tokenizer.type=huggingface", "tokenizer.path=tok", "model.num_layers=2",
        "model.seq_length=128"]


def run(cwd: Path, *args):
    """`megacli ARGS` in ``cwd``, its one worker in the CLI's process; must exit 0."""
    return ok(megacli_here(*map(str, args), cwd=cwd))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    from tests import _convert_models as cm

    root = tmp_path_factory.mktemp("carries")
    train, moved, elsewhere = root / "train", root / "moved", root / "elsewhere"
    for d in (train, moved, elsewhere):
        d.mkdir()
    cm.save_tokenizer(train / "tok")
    (train / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ({"messages": CHAT}, {"prompt": "lazy", "response": "dog"})))
    pre = run(train, "pretrain", *sets_args([*TINY, f"train.iters={ITERS}", f"optim.warmup_iters={WARMUP}", f"optim.lr={LR}",
                                            "optim.min_lr=0", "optim.decay_style=linear", "checkpoint.dir=ck", "run.dir=pre"]))
    # finetuned from it on chats, the pretraining checkpoint's recipe.yaml as the recipe
    run(train, "finetune", f"ck/iter_{ITERS:07d}/recipe.yaml",
        *sets_args(["data.mock=false", "sft.train=sft.jsonl", "sft.template=chatml", "sft.valid_fraction=0",
                    "optim.warmup_iters=0", "checkpoint.pretrained=ck", "checkpoint.dir=ft", "train.iters=2",
                    "run.dir=ft_run", "train.micro_batch_size=1", "train.global_batch_size=2"]))
    shutil.move(str(train / "ft"), str(moved / "ft"))
    (train / "tok").rename(train / "tok_gone")  # nothing of the training directory is read any more
    return {"root": root, "train": train, "ckpt": moved / "ft", "elsewhere": elsewhere,
            "sft": train / "sft.jsonl", "tok": train / "tok_gone", "pretrain_console": pre.stdout}


def test_the_logged_lr_is_the_rate_the_step_used(trained):
    """Megatron-Core's schedule: step k trains at the rate of num_steps = k - 1 (linear warmup from 0
    to LR over WARMUP steps, then linear decay to 0 at ITERS); the step's line says that rate."""

    def rate(num_steps: int) -> float:
        if num_steps <= WARMUP:
            return LR * num_steps / WARMUP
        return LR * (1 - (num_steps - WARMUP) / (ITERS - WARMUP))

    logged = {r["iteration"]: r["lr"] for r in records(trained["train"] / "pre") if "loss" in r}
    assert sorted(logged) == list(range(1, ITERS + 1))
    assert logged[1] == 0.0  # the first step, in warmup, trained at 0
    for k, lr in logged.items():
        assert lr == pytest.approx(rate(k - 1), rel=1e-9, abs=1e-12), (k, lr, rate(k - 1))
    console = [line for line in trained["pretrain_console"].splitlines() if "lr " in line and "loss" in line]
    assert len(console) == ITERS and "lr 0.000e+00" in console[0] and f"lr {rate(1):.3e}" in console[1], console


def test_the_checkpoint_holds_its_tokenizer_and_template_once(trained):
    from megacli.data.sft import JINJA_TEMPLATES

    ckpt = trained["ckpt"]
    iterations = sorted(ckpt.glob("iter_*"))
    assert iterations and sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["hf", *[p.name for p in iterations]]
    for it in iterations:
        assert yaml.safe_load((it / "recipe.yaml").read_text())["tokenizer"] == {"type": "huggingface", "path": "../hf"}
    assert (ckpt / "hf" / "tokenizer.json").read_bytes() == (trained["tok"] / "tokenizer.json").read_bytes()
    config = json.loads((ckpt / "hf" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == JINJA_TEMPLATES["chatml"]
    pre = trained["train"] / "ck" / "hf"  # pretraining carries the tokenizer as it is: no template
    assert "chat_template" not in json.loads((pre / "tokenizer_config.json").read_text())


def _training_and_serving_ids(ckpt: str, cwd: str) -> dict:
    """In ``cwd``: the ids finetuning trained on for CHAT, and those serve and generate --chat give
    the conversation's prompt, by the moved checkpoint's recipe."""
    import os

    os.chdir(cwd)
    from megacli.cli.generate import build_recipe
    from megacli.data.sft import render, tokenize
    from megacli.data.tokenizers import load_tokenizer
    from megacli.inference.job import chat_prompts
    from megacli.inference.serve.job import chat_template

    recipe = build_recipe(None, {"checkpoint": ckpt}, tensor=None, pipeline=None, overrides=[], job="serve")
    tok = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path)
    trained = tokenize({"messages": CHAT}, tok, "chatml").ids
    prompt_pieces = render({"messages": CHAT}, "chatml")[:-1]  # all but the answer: what a server is given
    prompt_len = sum(len(tok.encode(text)) for text, _ in prompt_pieces)
    return {"trained": trained, "prompt_len": prompt_len, "tokenizer_path": recipe.tokenizer.path,
            "served": tok.encode(chat_template(recipe)(CHAT[:1])),
            "served_whole": tok.encode(chat_template(recipe)(CHAT).removesuffix("<|im_start|>assistant\n")),
            "generate_chat": tok.encode(chat_prompts(recipe.tokenizer.path, [CHAT[0]["content"]])[0])}


def test_serve_and_generate_chat_render_what_training_rendered(trained):
    status, ids = warm_call(_training_and_serving_ids, str(trained["ckpt"]), str(trained["elsewhere"]))
    assert status == "ok", ids
    assert ids["tokenizer_path"] == str(trained["ckpt"] / "hf")
    assert ids["served"] == ids["generate_chat"] == ids["trained"][: ids["prompt_len"]]
    assert ids["trained"][-1] != ids["served"][-1]
    whole = ids["trained"][:-1]  # training appends the end-of-document token after the conversation
    assert ids["served_whole"] == whole


def test_moved_checkpoint_generates_and_gives_its_recipe(trained):
    ckpt, here = trained["ckpt"], trained["elsewhere"]
    out = run(here, "generate", "-c", ckpt, "--chat", "--prompt", "the quick brown", "-n", "3", "-o", "gen.jsonl",
              "--set", "run.dir=gen_run")
    record = json.loads((here / "gen.jsonl").read_text())
    assert record["prompt"] == "<|im_start|>user\nthe quick brown<|im_end|>\n<|im_start|>assistant\n", out.stdout
    assert len(record["tokens"]) >= 1
    run(here, "recipe", "from", ckpt, "-o", "from.yaml")
    tokenizer = yaml.safe_load((here / "from.yaml").read_text())["tokenizer"]
    assert tokenizer == {"type": "huggingface", "path": str(ckpt / "hf")}


def test_moved_checkpoint_evaluates(trained):
    pytest.importorskip("lm_eval")
    from tests.test_eval import write_tasks

    ckpt, here = trained["ckpt"], trained["elsewhere"]
    tasks = write_tasks(here / "eval")
    run(here, "eval", ckpt, "--tasks", "tiny_lambada", "--limit", "2", "--include-path", tasks, "-o", "eval.json",
        "--set", "run.dir=eval_run")
    assert "tiny_lambada" in json.loads((here / "eval.json").read_text())["results"]


def _exported_and_trained_prompt(export: str, carried: str) -> tuple[list[int], list[int]]:
    """transformers' apply_chat_template on the Hugging Face export, and the ids training gave the
    same prompt (the conversation up to the answer, piece by piece with the checkpoint's tokenizer)."""
    from transformers import AutoTokenizer

    from megacli.data.sft import render
    from megacli.data.tokenizers import load_tokenizer

    ours = load_tokenizer(type="huggingface", path=carried)
    trained_prompt = [i for text, _ in render({"messages": CHAT}, "chatml")[:-1] for i in ours.encode(text)]
    exported = AutoTokenizer.from_pretrained(export).apply_chat_template(CHAT[:1], add_generation_prompt=True, tokenize=True)
    return list(exported["input_ids"] if hasattr(exported, "keys") else exported), trained_prompt


def test_moved_checkpoint_converts_to_hf_with_its_template(trained):
    here = trained["elsewhere"]
    run(here, "convert", trained["ckpt"], "hf_out", "--to", "hf")
    status, answer = warm_call(_exported_and_trained_prompt, str(here / "hf_out"), str(trained["ckpt"] / "hf"))
    assert status == "ok", answer
    exported, trained_prompt = answer
    assert exported == trained_prompt and len(exported) > 10


def test_moved_checkpoint_reshards_finetunes_and_resumes(trained):
    ckpt, here = trained["ckpt"], trained["elsewhere"]
    it = sorted(ckpt.glob("iter_*"))[-1]
    run(here, "reshard", ckpt, "resharded", "--pipeline", "2")
    resharded = here / "resharded"
    assert (resharded / "hf" / "tokenizer.json").is_file()
    r_it = sorted(resharded.glob("iter_*"))[-1]
    assert yaml.safe_load((r_it / "recipe.yaml").read_text())["tokenizer"]["path"] == "../hf"
    # finetune from it, the checkpoint's own recipe as the run's (its tokenizer: the copy it carries)
    sets = [f"sft.train={trained['sft']}", "train.iters=1", "checkpoint.dir=again", "run.dir=again_run",
            f"checkpoint.pretrained={ckpt}", "checkpoint.resume=none"]
    run(here, "finetune", it / "recipe.yaml", *sets_args(sets))
    assert (here / "again" / "hf" / "tokenizer.json").is_file()
    # resume it where it is: one more step, saved beside the others; the carried tokenizer is not a change
    sets = [f"sft.train={trained['sft']}", "train.iters=3", f"checkpoint.dir={ckpt}", f"checkpoint.resume={ckpt}",
            f"checkpoint.pretrained={ckpt}", "run.dir=resume_run"]
    out = run(here, "finetune", it / "recipe.yaml", *sets_args(sets))
    assert "resuming from" in out.stdout.lower() or "resumed" in out.stdout.lower(), out.stdout[-2000:]
    assert "tokenizer.path" not in out.stdout
    assert (ckpt / "latest").read_text().strip() == "iter_0000003"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("hf")) == ["hf"]


def test_a_checkpoint_from_before_names_its_tokenizer_from_the_working_directory(trained, tmp_path, monkeypatch):
    """A recipe.yaml whose tokenizer.path is relative to where training ran (as checkpoints written
    before this change have it): read from the working directory; when it is not there, the message
    names where it was looked for."""
    from megacli.checkpoint.layout import read_recipe
    from megacli.data.tokenizers import load_tokenizer
    from megacli.errors import UserError

    old = tmp_path / "old" / "iter_0000002"
    old.mkdir(parents=True)
    (old / "megacli.json").write_text(json.dumps({"iteration": 2, "consumed_samples": 4}))
    (old / "recipe.yaml").write_text(yaml.safe_dump({"tokenizer": {"type": "huggingface", "path": "tok_gone"}}))
    monkeypatch.chdir(trained["train"])
    path = read_recipe(old)["tokenizer"]["path"]
    assert path == "tok_gone" and load_tokenizer(type="huggingface", path=path).vocab_size > 256
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as exc:
        load_tokenizer(type="huggingface", path=read_recipe(old)["tokenizer"]["path"])
    assert str(exc.value) == (f"tokenizer.path = 'tok_gone' ({tmp_path / 'tok_gone'}; relative paths are read from the "
                              f"working directory): no such file or directory")
