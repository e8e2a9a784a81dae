"""`megacli serve`: the official `openai` client against the real command on loopback.

A spawned process builds a tiny GPT-2 and a tiny Llama (Hugging Face, random weights), converts
them, and records what `megacli generate` and `megacli eval` (their CLIs, in that process) give on
them. The servers are `megacli serve` subprocesses on free ports; every request has a timeout and
every server is stopped (SIGTERM) when its tests end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402  (openai's; imported here, not first in a client thread)

from megacli.checkpoint.source import Source

NAMES = ["gpt2", "llama_tied_gqa"]
PROMPTS = ["the quick brown", "lazy dog jumps over the", "fox", "over the lazy dog the quick brown fox jumps"]
CHATS = [[{"role": "user", "content": "the quick brown fox"}],
         [{"role": "system", "content": "the"}, {"role": "user", "content": "lazy dog"},
          {"role": "assistant", "content": "jumps"}, {"role": "user", "content": "over the"}]]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")
SYSTEM = "over the lazy dog the quick brown fox jumps over the lazy dog: "
SHARED = [SYSTEM + q for q in ("the fox", "a dog jumps", "the quick brown", "lazy")]  # one long prefix, four questions
NEW = 12
EVAL_TASKS = ["tiny_lambada", "tiny_choice", "tiny_generate"]  # tiny_rolling's windows fill the context: no room for max_tokens=1
API_KEY = "sk-test-0123456789abcdef"
TIMEOUT = 60


def _cli(*args, env: dict | None = None):
    """`megacli ARGS` in this process, through its CLI."""
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    return CliRunner().invoke(app, [*map(str, args)], env={"COLUMNS": "400", **(env or {})})


def _prepare(rank, world, root: str):
    """Models, converted checkpoints (tokenizers with a chat template), and `megacli generate` /
    `megacli eval` outputs on them."""
    from transformers import AutoTokenizer

    from megacli.convert import convert
    from tests import _convert_models as cm
    from tests.test_eval import write_tasks

    root = Path(root)
    tasks = write_tasks(root)
    refs = {}
    for name in NAMES:
        cm.build_hf(name, root / name / "hf", with_tokenizer=True)
        convert(Source(root / name / "hf"), root / name / "mc", say=lambda *_: None)
        tok_dir = root / name / "mc" / "hf"
        config = json.loads((tok_dir / "tokenizer_config.json").read_text())
        (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
        hf_tok = AutoTokenizer.from_pretrained(tok_dir)
        chat_prompts = [hf_tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in CHATS]
        prompts = root / name / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS + chat_prompts + SHARED))
        out = root / name / "generated.jsonl"
        res = _cli("generate", "--checkpoint", root / name / "mc", "--prompts", prompts, "-n", NEW, "-o", out,
                   "--set", f"run.dir={root / name / 'run'}")
        assert res.exit_code == 0, res.output
        records = [json.loads(line) for line in out.read_text().splitlines()]
        refs[name] = {"completions": records[: len(PROMPTS)], "chats": records[len(PROMPTS) : -len(SHARED)],
                      "shared": records[-len(SHARED) :],
                      "pieces": {r["prompt"]: [hf_tok.decode([t]) for t in r["tokens"]] for r in records}}
    res = _cli("generate", "--checkpoint", root / "gpt2" / "mc", "--prompts", root / "gpt2" / "prompts.jsonl", "-n", NEW,
               "-o", root / "tiny_temperature.jsonl", "--temperature", "1e-300", "--set", f"run.dir={root / 'tiny_run'}")
    assert res.exit_code == 0, res.output
    refs["tiny_temperature"] = [json.loads(line) for line in (root / "tiny_temperature.jsonl").read_text().splitlines()]
    refs["hf_dir"] = _from_hf_dir(root / "gpt2")
    refs["megatron_lm"] = _from_megatron_lm(root / "gpt2")
    out = root / "eval.json"
    res = _cli("eval", root / "gpt2" / "mc", "--tasks", ",".join(EVAL_TASKS), "--include-path", tasks,
               "-o", out, "--set", "eval.log_samples=true", "--set", "eval.bootstrap_iters=0",
               "--set", f"run.dir={root / 'eval_run'}")
    assert res.exit_code == 0, res.output
    refs["eval"] = json.loads(out.read_text())
    return refs


def _generated(ckpt: Path, prompts: Path, out: Path, run_dir: Path):
    """`megacli generate -c CKPT` on the prompts: its records and what it said on stderr."""
    res = _cli("generate", "-c", ckpt, "--prompts", prompts, "-n", NEW, "-o", out, "--set", f"run.dir={run_dir}")
    assert res.exit_code == 0, res.output
    return [json.loads(line) for line in out.read_text().splitlines()], res.stderr


def _from_hf_dir(d: Path) -> dict:
    """`generate -c HF_DIR` (converted into its run directory), generate on that conversion, and Hugging
    Face's own greedy tokens; then which later conversions into the same place were reused."""
    import shutil

    import torch
    from transformers import AutoTokenizer

    from megacli.convert.in_run import converted_in_run
    from tests import _convert_models as cm

    prompts, run_dir = d / "prompts.jsonl", d / "hf_run"
    out = {"run_dir": str(run_dir)}
    out["from_hf_dir"], out["said"] = _generated(d / "hf", prompts, d / "hf_dir.jsonl", run_dir)
    out["from_converted"], _ = _generated(run_dir / "converted" / "hf", prompts, d / "converted.jsonl", d / "conv_run")
    model, tok = cm.load_hf(d / "hf"), AutoTokenizer.from_pretrained(d / "hf")
    out["hf_greedy"] = []
    for r in out["from_hf_dir"]:
        ids = tok.encode(r["prompt"])
        with torch.no_grad():
            tokens = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW, pad_token_id=tok.eos_token_id)
        out["hf_greedy"].append(tokens[0, len(ids):].tolist())
    out["hf_pieces"] = [[tok.decode([t]) for t in tokens] for tokens in out["hf_greedy"]]
    # into a copy of that run directory: the same files elsewhere, then one file changed (both
    # directories named hf, as the source)
    same, changed, later_run = d / "same" / "hf", d / "changed" / "hf", d / "later_run"
    shutil.copytree(d / "hf", same)
    shutil.copytree(d / "hf", changed)
    shutil.copytree(run_dir, later_run)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "note": "changed"}))
    out["later"] = {"run_dir": str(later_run)}
    for key, src in (("same", same), ("changed", changed)):
        said = []
        converted_in_run(Source(src), later_run, tensor=1, pipeline=1, dtype=None, say=said.append)
        meta = json.loads((later_run / "converted" / "hf" / "iter_0000000" / "megacli.json").read_text())
        out["later"][key] = {"said": said, "converted_from": meta["converted_from"]["path"]}
    return out


def _from_megatron_lm(d: Path) -> dict:
    """The converted GPT-2 exported as a Megatron-LM torch_dist checkpoint, and `megacli generate` on it;
    and exported as a legacy one, which generate converts into its run directory first."""
    res = _cli("reshard", d / "mc", d / "mlm", "--format", "megatron", "--no-progress")
    assert res.exit_code == 0, res.output
    records, _ = _generated(d / "mlm", d / "prompts.jsonl", d / "mlm.jsonl", d / "mlm_run")
    res = _cli("reshard", d / "mc", d / "mlm_legacy", "--format", "legacy", "--no-progress")
    assert res.exit_code == 0, res.output
    legacy, said = _generated(d / "mlm_legacy", d / "prompts.jsonl", d / "mlm_legacy.jsonl", d / "mlm_legacy_run")
    return {"generated": records, "legacy": legacy, "legacy_said": said}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("serve")
    return root, spawn(_prepare, 1, str(root), timeout=900)[0]


class Server:
    """`megacli serve ARGS` on a free loopback port, up until stop()."""

    def __init__(self, ckpt: Path, *args, env: dict | None = None):
        # A free port can be taken by another process before the server binds it (the workers'
        # gloo connections use the same range): then again on another one.
        for attempt in range(3):
            if self._start(ckpt, args, env) or "address already in use" not in "".join(self.lines) or attempt == 2:
                break
        if not any(line.startswith("serving ") for line in self.lines):
            raise AssertionError("the server did not start:\n" + "".join(self.lines)[-4000:])
        self.url = f"http://127.0.0.1:{self.port}"

    def _start(self, ckpt: Path, args, env: dict | None) -> bool:
        from tests._dist import free_port

        self.port = free_port()
        cmd = [sys.executable, "-m", "megacli", "serve", ckpt, "--port", self.port,
               "--set", f"run.dir={ckpt.parent / f'serve_run_{self.port}'}", *args]
        self.proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("serving "):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if ready.wait(180) and any(line.startswith("serving ") for line in self.lines):
            return True
        self.stop()
        return False

    def client(self, key: str = "unused", cls=None):
        return (cls or openai.OpenAI)(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT)

    def get(self, path: str, timeout: float = TIMEOUT, **kw):
        return httpx.get(self.url + path, timeout=timeout, **kw)

    def post(self, path: str, body, timeout: float = TIMEOUT, **kw):
        return httpx.post(self.url + path, json=body, timeout=timeout, **kw)

    def metric(self, name: str, headers=None) -> float:
        for line in self.get("/metrics", headers=headers).text.splitlines():
            if line.startswith(f"megacli_{name} "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@pytest.fixture(scope="module")
def servers(prepared):
    """GPT-2: 8 slots, a cache no longer than the context (so columns shift often) and a prefill
    budget of 6 tokens (so longer prompts go in by parts); Llama: an API key, and a context raised
    to 1024 positions (RoPE has no table to outgrow) for long streams."""
    root, _ = prepared
    up = {}
    try:
        up["gpt2"] = Server(root / "gpt2" / "mc", "--max-batch", 8, "--set", "serve.cache_length=64",
                            "--set", "serve.prefix_block=4", "--set", "serve.prefill_tokens=6")
        up["llama_tied_gqa"] = Server(root / "llama_tied_gqa" / "mc", "--api-key", API_KEY,
                                      "--set", "model.max_position_embeddings=1024")
        yield up
    finally:
        for server in up.values():
            server.stop()


def _key(name: str) -> str:
    return API_KEY if name == "llama_tied_gqa" else "unused"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_openai_client_equals_generate(prepared, servers, name):
    """Completions, chat, streamed or not, one prompt or several: generate's greedy text, token for token."""
    _, refs = prepared
    ref, server = refs[name], servers[name]
    client = server.client(_key(name))
    assert [m.id for m in client.models.list().data] == ["mc"]
    for want in ref["completions"]:
        got = client.completions.create(model="mc", prompt=want["prompt"], max_tokens=NEW, temperature=0, logprobs=0)
        assert got.choices[0].text == want["text"]
        assert got.choices[0].logprobs.tokens == ref["pieces"][want["prompt"]]
        streamed = client.completions.create(model="mc", prompt=want["prompt"], max_tokens=NEW, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == want["text"]
    together = client.completions.create(model="mc", prompt=PROMPTS, max_tokens=NEW, temperature=0)
    assert [c.text for c in sorted(together.choices, key=lambda c: c.index)] == [r["text"] for r in ref["completions"]]
    for messages, want in zip(CHATS, ref["chats"]):
        got = client.chat.completions.create(model="mc", messages=messages, max_tokens=NEW, temperature=0, logprobs=True)
        assert got.choices[0].message.content == want["text"]
        assert [t.token for t in got.choices[0].logprobs.content] == ref["pieces"][want["prompt"]]
        streamed = client.chat.completions.create(model="mc", messages=messages, max_tokens=NEW, temperature=0, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == want["text"]


@pytest.mark.slow
def test_logprobs_while_streaming_and_logit_bias(prepared, servers):
    """Streamed chunks carry the logprobs of their tokens: together, those of the whole answer;
    a logit_bias of 100 makes greedy decoding repeat its token."""
    _, refs = prepared
    client = servers["gpt2"].client()
    for want in refs["gpt2"]["completions"][:2]:
        whole = client.completions.create(model="mc", prompt=want["prompt"], max_tokens=NEW, temperature=0, logprobs=2)
        chunks = list(client.completions.create(model="mc", prompt=want["prompt"], max_tokens=NEW, temperature=0,
                                                logprobs=2, stream=True))
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert [t for p in parts for t in p.tokens] == whole.choices[0].logprobs.tokens == ref_pieces(refs, want)
        assert [x for p in parts for x in p.token_logprobs] == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)
        # the second request reuses the first one's prompt from the prefix cache: its prefill sums in
        # another order, so its log-probabilities agree to rounding, as the chosen tokens' above
        tops, whole_tops = [x for p in parts for x in p.top_logprobs], whole.choices[0].logprobs.top_logprobs
        assert [list(t) for t in tops] == [list(t) for t in whole_tops]
        assert [list(t.values()) for t in tops] == [pytest.approx(list(t.values()), abs=1e-5) for t in whole_tops]
    for messages, want in zip(CHATS, refs["gpt2"]["chats"]):
        chunks = list(client.chat.completions.create(model="mc", messages=messages, max_tokens=NEW, temperature=0,
                                                     logprobs=True, top_logprobs=2, stream=True))
        content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert [t.token for t in content] == ref_pieces(refs, want) and all(len(t.top_logprobs) == 2 for t in content)
    biased = client.completions.create(model="mc", prompt="fox", max_tokens=NEW, temperature=0, logprobs=0,
                                       logit_bias={"17": 100})
    tokens = biased.choices[0].logprobs.tokens
    assert len(tokens) == NEW and len(set(tokens)) == 1 and biased.choices[0].text == tokens[0] * NEW


def _shared_prefix_equals_generate(server, refs: dict, key: str = "unused") -> None:
    """The shared-prefix prompts, one by one then together: generate's greedy text (no prefix
    cache there), with most of their prompt tokens taken from the server's prefix cache."""
    client, auth = server.client(key), {"Authorization": f"Bearer {key}"}
    hits = server.metric("prefix_cache_hit_tokens_total", auth)
    for want in refs["shared"]:
        got = client.completions.create(model="mc", prompt=want["prompt"], max_tokens=NEW, temperature=0)
        assert got.choices[0].text == want["text"]
    together = client.completions.create(model="mc", prompt=SHARED, max_tokens=NEW, temperature=0)
    assert [c.text for c in sorted(together.choices, key=lambda c: c.index)] == [r["text"] for r in refs["shared"]]
    assert server.metric("prefix_cache_hit_tokens_total", auth) - hits >= 5 * len(SYSTEM.split())


@pytest.mark.slow
def test_prefix_cache_gives_the_greedy_text_of_generate(prepared, servers):
    _, refs = prepared
    _shared_prefix_equals_generate(servers["gpt2"], refs["gpt2"])


_BOUNDED = {"additionalProperties": False}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"], **_BOUNDED},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, "x", None, True]},
    {"const": {"k": [1, 2]}},
    {"type": "string", "maxLength": 6},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "integer", "exclusiveMinimum": 10, "maximum": 12},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": [0, 1]}], "items": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "string", "maxLength": 3}]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "boolean"}},
                                            "required": ["q"], **_BOUNDED}}, "required": ["p"], **_BOUNDED},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}}, "required": ["a", "b"],
     **_BOUNDED},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}, "required": ["b"], **_BOUNDED},
    {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["n"], **_BOUNDED}, "maxItems": 2},
    {"$defs": {"flag": {"type": "boolean"}}, "type": "object", "properties": {"f": {"$ref": "#/$defs/flag"}},
     "required": ["f"], **_BOUNDED},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"], **_BOUNDED},
]


@pytest.mark.slow
def test_structured_output_validates_against_every_schema(servers):
    """response_format json_schema, greedy on the random model: every answer ends by itself and
    validates with jsonschema; an unsupported schema feature is a 400 naming it."""
    import jsonschema

    pytest.importorskip("llguidance")
    server = servers["llama_tied_gqa"]
    client = server.client(API_KEY)

    async def answers():
        async with server.client(API_KEY, cls=openai.AsyncOpenAI) as aclient:
            return await asyncio.gather(*(aclient.chat.completions.create(
                model="mc", messages=CHATS[i % 2], max_tokens=120, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
                for i, schema in enumerate(SCHEMAS)))

    for schema, chat in zip(SCHEMAS, asyncio.run(answers())):
        answer = chat.choices[0]
        assert answer.finish_reason == "stop", (schema, answer.message.content)
        jsonschema.validate(json.loads(answer.message.content), schema)
    got = client.completions.create(model="mc", prompt="the", max_tokens=120, temperature=0.9, seed=3,
                                    extra_body={"response_format": {"type": "json_schema",
                                                                    "json_schema": {"schema": SCHEMAS[17]}}})
    jsonschema.validate(json.loads(got.choices[0].text), SCHEMAS[17])
    anything = client.chat.completions.create(model="mc", messages=CHATS[0], max_tokens=120, temperature=0,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].finish_reason == "stop", anything.choices[0].message.content
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "dependentSchemas": {"a": {}}}}}
    _error(server.post("/v1/completions", {"model": "mc", "prompt": "x", "response_format": bad}, headers=auth), 400,
           "dependentSchemas", param="response_format")
    _error(server.post("/v1/completions", {"model": "mc", "prompt": "x", "response_format": {"type": "yaml"}},
                       headers=auth), 400, "yaml", param="response_format")


def ref_pieces(refs, record) -> list[str]:
    return refs["gpt2"]["pieces"][record["prompt"]]


@pytest.mark.slow
def test_generate_at_a_tiny_temperature_samples_the_argmax(prepared):
    _, refs = prepared
    want = refs["gpt2"]["completions"] + refs["gpt2"]["chats"] + refs["gpt2"]["shared"]
    assert [r["tokens"] for r in refs["tiny_temperature"]] == [r["tokens"] for r in want]


@pytest.mark.slow
def test_a_hugging_face_directory_is_converted_once_and_served(prepared):
    """`generate -c HF_DIR` and `serve HF_DIR` run the conversion megacli made in the run directory (made
    once, reused while the source's files are the same): generate's text on it, Hugging Face's greedy tokens."""
    root, refs = prepared
    ref = refs["hf_dir"]
    converted = Path(ref["run_dir"]) / "converted" / "hf"
    assert f"converting it (TP=1 PP=1, its own precision) into {converted}" in ref["said"]
    assert ref["from_hf_dir"] == ref["from_converted"]
    assert [r["tokens"] for r in ref["from_hf_dir"]] == ref["hf_greedy"]
    later = ref["later"]
    again = Path(later["run_dir"]) / "converted" / "hf"
    assert later["same"]["said"] == [f"{root / 'gpt2' / 'same' / 'hf'}: using {again}, converted from the same files before"]
    assert later["same"]["converted_from"] == str(root / "gpt2" / "hf")
    assert later["changed"]["said"] == [f"{root / 'gpt2' / 'changed' / 'hf'}: a Hugging Face model; converting it "
                                        f"(TP=1 PP=1, its own precision) into {again}"]
    assert later["changed"]["converted_from"] == str(root / "gpt2" / "changed" / "hf")
    server = Server(root / "gpt2" / "hf", "--set", f"run.dir={ref['run_dir']}")
    try:
        assert f"using {converted}, converted from the same files before" in "".join(server.lines)
        got = server.client().completions.create(model="hf", prompt=PROMPTS, max_tokens=NEW, temperature=0, logprobs=0)
        want = ref["from_hf_dir"][: len(PROMPTS)]
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [r["text"] for r in want]
        assert [c.logprobs.tokens for c in sorted(got.choices, key=lambda c: c.index)] == ref["hf_pieces"][: len(PROMPTS)]
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_a_megatron_lm_checkpoint_is_served(prepared):
    """A Megatron-LM torch_dist checkpoint (the model from its args): generate's greedy text on it."""
    root, refs = prepared
    want = refs["megatron_lm"]["generated"]
    server = Server(root / "gpt2" / "mlm")
    try:
        client = server.client()
        got = client.completions.create(model="mlm", prompt=PROMPTS, max_tokens=NEW, temperature=0)
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [r["text"] for r in want[: len(PROMPTS)]]
        for messages, r in zip(CHATS, want[len(PROMPTS):]):
            chat = client.chat.completions.create(model="mlm", messages=messages, max_tokens=NEW, temperature=0)
            assert chat.choices[0].message.content == r["text"]
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_a_megatron_lm_legacy_checkpoint_is_converted_in_the_run_directory(prepared):
    """A legacy Megatron-LM checkpoint given to generate (serve and eval build their recipe the same
    way) is converted into the run directory first: the same greedy text as the megacli checkpoint
    it was exported from."""
    root, refs = prepared
    legacy = refs["megatron_lm"]["legacy"]
    assert [r["text"] for r in legacy] == [r["text"] for r in refs["gpt2"]["completions"] + refs["gpt2"]["chats"]
                                           + refs["gpt2"]["shared"]]
    assert "a Megatron-LM legacy checkpoint; converting it (TP=1 PP=1" in refs["megatron_lm"]["legacy_said"]
    assert (root / "gpt2" / "mlm_legacy_run" / "converted" / "mlm_legacy.source.json").is_file()


def _requests() -> list[dict]:
    """32 different requests: prompts and lengths vary, half greedy, half sampled with a seed,
    every other one streamed."""
    out = []
    for i in range(32):
        body = {"model": "mc", "prompt": PROMPTS[i % 4] + " the" * (i % 5), "max_tokens": 4 + (i * 7) % 17}
        body.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_k": 40, "seed": i})
        body["stream"] = i % 4 < 2
        out.append(body)
    return out


async def _send(client, body: dict) -> str:
    extra = {k: v for k, v in body.items() if k == "top_k"}
    args = {k: v for k, v in body.items() if k != "top_k"}
    res = await client.completions.create(**args, extra_body=extra)
    if body["stream"]:
        return "".join([chunk.choices[0].text async for chunk in res])
    return res.choices[0].text


@pytest.mark.slow
def test_32_concurrent_clients_get_what_each_gets_alone(servers):
    server = servers["gpt2"]
    requests = _requests()

    async def alone():
        async with server.client(cls=openai.AsyncOpenAI) as client:
            return [await _send(client, body) for body in requests]

    async def together():
        async with server.client(cls=openai.AsyncOpenAI) as client:
            return await asyncio.wait_for(asyncio.gather(*(_send(client, body) for body in requests)), timeout=120)

    expected = asyncio.run(alone())
    steps, tokens = server.metric("decode_steps_total"), server.metric("generated_tokens_total")
    got = asyncio.run(together())
    assert got == expected
    steps, tokens = server.metric("decode_steps_total") - steps, server.metric("generated_tokens_total") - tokens
    assert tokens >= 200 and steps < tokens / 3, (steps, tokens)  # decoded in batches, not one by one
    assert len({t for t, body in zip(got, requests) if body["temperature"]}) > 10, "sampled texts differ by seed"


@pytest.mark.slow
def test_cancelled_streams_free_their_slots(servers):
    server = servers["llama_tied_gqa"]
    client = server.client(API_KEY)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    cancelled, tokens = server.metric("cancelled_total", auth), server.metric("generated_tokens_total", auth)
    for _ in range(4):
        stream = client.completions.create(model="mc", prompt="the quick", max_tokens=1000, temperature=0, stream=True)
        next(iter(stream))
        stream.close()
    with pytest.raises(httpx.TimeoutException):  # a client that stops waiting for a whole answer
        server.post("/v1/completions", {"model": "mc", "prompt": "fox", "max_tokens": 1000, "temperature": 0},
                    headers=auth, timeout=0.5)
    deadline = time.monotonic() + 20
    while server.metric("batch_size", auth) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("batch_size", auth) == 0
    assert server.metric("cancelled_total", auth) == cancelled + 5
    assert server.metric("generated_tokens_total", auth) - tokens < 5 * 1000 / 2
    assert client.completions.create(model="mc", prompt="fox", max_tokens=3, temperature=0).choices[0].finish_reason


def _error(res, status: int, *words, param=None):
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) >= {"message", "type", "param"}
    for w in words:
        assert w in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.slow
def test_bad_requests_are_answered_and_the_server_lives(servers):
    server = servers["gpt2"]
    _error(server.post("/v1/completions", {"model": "mc", "prompt": "fox " * 70, "max_tokens": 4}), 400,
           "context of 64 tokens", param="prompt")
    _error(server.post("/v1/completions", {"model": "mc", "prompt": "fox", "max_tokens": 64}), 400,
           "max_tokens is 64", "64", param="max_tokens")
    _error(server.post("/v1/completions", {"model": "mc", "prompt": "fox", "temperature": 7}), 400, param="temperature")
    _error(server.post("/v1/completions", {"model": "mc", "prompt": [5, 999999]}), 400, "outside the vocabulary")
    _error(server.post("/v1/completions", {"model": "mc", "prompt": "fox", "logit_bias": {"999999": 3}}), 400, "logit_bias")
    _error(server.post("/v1/completions", {"model": "mc", "prompt": "fox", "logit_bias": {"1": 300}}), 400, "logit_bias")
    _error(server.post("/v1/chat/completions", {"model": "mc", "messages": []}), 400, param="messages")
    _error(server.post("/v1/chat/completions", {"model": "mc", "messages": CHATS[0], "tools": [{"type": "function"}]}),
           400, "tools")
    _error(server.post("/v1/completions", {"model": "gpt-4", "prompt": "fox"}), 404, "gpt-4", param="model")
    _error(server.get("/v1/nothing"), 404)
    res = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=TIMEOUT,
                     headers={"content-type": "application/json"})
    _error(res, 400)
    for many in (65, 10_000):  # more than --max-queue (64) ever takes: not worth retrying
        res = server.post("/v1/completions", {"model": "mc", "prompt": ["fox"] * many, "max_tokens": 2})
        _error(res, 400, f"{many} sequences", "at most 64", param="prompt")
        assert "retry-after" not in res.headers
    _error(server.post("/v1/completions", {"model": "mc", "prompt": "fox", "n": 5, "seed": 2**70}), 400, param="seed")
    greedy = server.post("/v1/completions", {"model": "mc", "prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0})
    for extreme in ({"temperature": 1e-300}, {"temperature": 1e-300, "top_p": 1e-300}, {"temperature": 2, "top_p": 1e-9}):
        res = server.post("/v1/completions", {"model": "mc", "prompt": PROMPTS[:2], "max_tokens": 6, "seed": 2**63 - 1,
                                              "n": 1, **extreme})
        assert res.status_code == 200, (extreme, res.text)
        assert [c["text"] for c in res.json()["choices"]] == [c["text"] for c in greedy.json()["choices"]], extreme
    forged = '/v1/x"} 1\nmegacli_forged_total 9'
    assert server.get(forged.replace("\n", "%0A")).status_code == 404
    for i in range(20):
        server.get(f"/v1/other_{i}")
    assert server.get("/health").json() == {"status": "ok"}
    metrics = server.get("/metrics").text
    assert "forged" not in metrics and "other_" not in metrics
    assert 'megacli_requests_total{endpoint="unmatched",status="404"}' in metrics
    assert 'megacli_requests_total{endpoint="/v1/completions",status="400"}' in metrics
    assert "megacli_queue_length 0" in metrics
    assert server.client().completions.create(model="mc", prompt="fox", max_tokens=2, temperature=0).choices[0].text is not None


@pytest.mark.slow
def test_api_key(servers):
    server = servers["llama_tied_gqa"]
    body = {"model": "mc", "prompt": "fox", "max_tokens": 2}
    _error(server.post("/v1/completions", body), 401, "API key")
    _error(server.post("/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert server.post("/v1/completions", body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()
    assert server.get("/health").status_code == 200
    _error(server.get("/metrics"), 401)
    _error(server.get('/v1/x"} 1%0Amegacli_forged_total 9'), 401)
    metrics = server.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    assert "forged" not in metrics and 'megacli_requests_total{endpoint="unmatched",status="401"}' in metrics
    printed = "".join(server.lines)
    assert API_KEY not in printed and "sk-…" in printed


@pytest.mark.slow
def test_non_loopback_host_needs_a_key(prepared, tmp_path):
    root, _ = prepared
    res = _cli("serve", root / "gpt2" / "mc", "--host", "0.0.0.0", "--set", f"run.dir={tmp_path}",
               env={"MEGACLI_API_KEY": None})
    assert res.exit_code == 2 and "0.0.0.0" in res.stderr and "API key" in res.stderr, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


@pytest.mark.slow
def test_lm_eval_local_completions_equals_megacli_eval(prepared, servers):
    import lm_eval
    from lm_eval.tasks import TaskManager

    root, refs = prepared
    server = servers["gpt2"]
    args = (f"model=mc,base_url={server.url}/v1/completions,tokenizer={root / 'gpt2' / 'mc' / 'hf'},"
            f"tokenizer_backend=huggingface,max_length=64,num_concurrent=1,max_retries=1,timeout={TIMEOUT}")
    got = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=EVAL_TASKS, batch_size=1,
                                  task_manager=TaskManager(include_path=str(root / "tasks"), include_defaults=False),
                                  log_samples=True, bootstrap_iters=0)
    want = refs["eval"]
    for task in EVAL_TASKS:
        mine = {k: v for k, v in got["results"][task].items() if "," in k and "stderr" not in k}
        theirs = {k: v for k, v in want["results"][task].items() if "," in k and "stderr" not in k}
        assert set(mine) == set(theirs)
        for key, value in theirs.items():
            if key.startswith(("acc", "exact_match")):
                assert mine[key] == value, (task, key)
            else:
                assert abs(mine[key] - value) <= 1e-4 * abs(value), (task, key, mine[key], value)
        answers = [s["filtered_resps"] for s in sorted(got["samples"][task], key=lambda s: s["doc_id"])]
        expected = [s["filtered_resps"] for s in sorted(want["samples"][task], key=lambda s: s["doc_id"])]
        for a_doc, b_doc in zip(answers, expected, strict=True):
            for a, b in zip(a_doc, b_doc, strict=True):
                if task == "tiny_generate":
                    assert a == b
                else:  # (log-likelihood, is greedy)
                    assert abs(a[0] - b[0]) <= 1e-4 * abs(b[0]) and a[1] == b[1], (task, a, b)


@pytest.mark.slow
def test_sigterm_finishes_requests_in_flight_then_exits_0(servers):
    """Last of the file: it stops the Llama server."""
    server = servers["llama_tied_gqa"]
    client = server.client(API_KEY)
    result = {}

    def long_request():
        try:
            result["r"] = client.completions.create(model="mc", prompt="the", max_tokens=900, temperature=0)
        except Exception as exc:  # shown by the assertion below
            result["error"] = repr(exc)

    worker = threading.Thread(target=long_request)
    worker.start()
    auth = {"Authorization": f"Bearer {API_KEY}"}
    deadline = time.monotonic() + 20
    while server.metric("batch_size", auth) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGTERM)
    refused = False
    while not refused and time.monotonic() < deadline:
        try:
            server.get("/health", timeout=1)
            time.sleep(0.02)
        except (httpx.ConnectError, httpx.ReadError):  # refused, or accepted as it closed and reset
            refused = "r" not in result  # no new connection while the request in flight still runs
    assert refused
    assert server.stop(timeout=60) == 0
    worker.join(TIMEOUT)
    assert "r" in result, result
    choice = result["r"].choices[0]
    assert choice.finish_reason == "length" and result["r"].usage.completion_tokens == 900 or choice.finish_reason == "stop"


def test_streamed_text_holds_back_what_may_become_a_stop_string():
    """Deltas concatenate to the final text, which `megacli generate`'s rule cuts before the first
    stop string (and after a stop token); a tail that may still become a stop string is not sent."""
    from megacli.inference.serve.batcher import TextSoFar

    class Chars:  # token id = a character's code
        @staticmethod
        def decode(ids):
            return "".join(map(chr, ids))

    def run(text: str, stop: list[str], stop_ids=frozenset()):
        so_far, sent, generated = TextSoFar(Chars, stop, set(stop_ids)), [], []
        for ch in text:
            generated.append(ord(ch))
            full, hit = so_far.text(generated)
            sent.append(so_far.delta(full, final=hit or ch == text[-1]))
            if hit:
                break
        return sent, full

    sent, full = run("ab\ncd\n\nef", ["\n\n"])
    assert full == "ab\ncd" and "".join(sent) == full
    assert sent[2] == "" and sent[3] == "\nc", "the newline waits until it cannot start the stop string"
    sent, full = run("abc\x00", [], stop_ids={0})
    assert full == "abc" and "".join(sent) == "abc"
    sent, full = run("xyz", ["yq"])
    assert full == "xyz" and sent == ["x", "", "yz"]


@pytest.mark.slow
def test_tp2_pp2_equals_generate(prepared, tmp_path):
    """Rank 0 of four (TP=2 x PP=2) serves; the other ranks follow its batches."""
    root, refs = prepared
    for name in NAMES:
        server = Server(root / name / "mc", "--tensor", 2, "--pipeline", 2, "--set", f"run.dir={tmp_path / name}",
                        "--set", "serve.prefix_block=4")
        try:
            client = server.client()
            got = client.completions.create(model="mc", prompt=PROMPTS, max_tokens=NEW, temperature=0)
            assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [r["text"] for r in refs[name]["completions"]]
            _shared_prefix_equals_generate(server, refs[name])
            tiny = client.completions.create(model="mc", prompt=PROMPTS, max_tokens=NEW, temperature=1e-300, seed=1)
            assert [c.text for c in sorted(tiny.choices, key=lambda c: c.index)] == [r["text"] for r in refs[name]["completions"]]
            for messages, want in zip(CHATS, refs[name]["chats"]):
                streamed = client.chat.completions.create(model="mc", messages=messages, max_tokens=NEW, temperature=0,
                                                          stream=True)
                assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == want["text"]
        finally:
            assert server.stop() == 0
