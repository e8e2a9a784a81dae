"""A Hugging Face config.json megacli cannot take (not an object, a size no model has) is refused
by every command that reads one, with one message naming the file and the key (checkpoint/hf_config.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import cli

GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1,
        "n_positions": 16, "vocab_size": 64}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 16, "max_position_embeddings": 16,
         "vocab_size": 64}

BAD = {  # name: (config.json's bytes, what the message must say)
    "a list": (b"[1, 2]", "not a Hugging Face config (a JSON object), but a JSON list"),
    "not UTF-8": (b'{"n_embd": "\xff"}', "cannot read"),
    "zero heads": (json.dumps({**GPT2, "n_head": 0}).encode(), "n_head = 0: expected a positive integer"),
    "negative size": (json.dumps({**LLAMA, "intermediate_size": -16}).encode(), "intermediate_size = -16"),
    "fractional size": (json.dumps({**GPT2, "n_embd": 8.5}).encode(), "n_embd = 8.5: expected a positive integer"),
    "a boolean size": (json.dumps({**LLAMA, "num_hidden_layers": True}).encode(), "num_hidden_layers = true"),
    "a string size": (json.dumps({**GPT2, "vocab_size": "64"}).encode(), 'vocab_size = "64"'),
    "heads not dividing": (json.dumps({**GPT2, "n_head": 3}).encode(), "n_head = 3 does not divide n_embd = 8"),
    "groups not dividing": (json.dumps({**LLAMA, "num_key_value_heads": 3}).encode(),
                            "num_key_value_heads = 3 does not divide num_attention_heads = 4"),
    "architectures a string": (json.dumps({**GPT2, "architectures": "GPT2LMHeadModel"}).encode(), "architectures ="),
}


def commands(hf, run):
    out = [("recipe", "from", hf), ("convert", hf, run / "out"), ("generate", "-c", hf, "--prompt", "x",
                                                                    "--set", f"run.dir={run}")]
    if importlib.util.find_spec("fastapi") and importlib.util.find_spec("sse_starlette"):
        out.append(("serve", hf, "--set", f"run.dir={run}"))
    return out


@pytest.mark.parametrize("name", BAD)
def test_every_reader_refuses_a_bad_config_naming_file_and_key(tmp_path, name):
    content, said = BAD[name]
    hf, run = tmp_path / "hf", tmp_path / "run"
    hf.mkdir()
    (hf / "config.json").write_bytes(content)
    for command in commands(hf, run):
        res = cli(*command)
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and "Traceback" not in res.output, (command, res.output)
        assert f"{hf / 'config.json'}" in text and said in text, (command, text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "nothing written"


def test_sizes_models_have_pass():
    """Its own head size (Llama's head_dim, T5's d_kv) frees the heads from dividing the hidden size;
    0 experts is a dense model. (Every config the convert tests build passes through it there.)"""
    from megacli.checkpoint.hf_config import check_config

    for config in (GPT2, LLAMA, {**LLAMA, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 3,
                                 "num_experts": 0, "n_inner": None},
                   {"architectures": ["T5ForConditionalGeneration"], "d_model": 8, "num_heads": 3, "d_kv": 4}):
        check_config(config, "config.json")
