"""The convert example of docs/commands/convert.md and recipes/llama3_1b_sft.yaml, run as written on a directory whose
config.json is Llama-3.2-1B's (rope_scaling block included) with smaller sizes and random weights."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parent.parent
RECIPE = ROOT / "recipes" / "llama3_1b_sft.yaml"
PAGE = ROOT / "docs/commands/convert.md"
# meta-llama/Llama-3.2-1B's config.json; only the sizes (marked) are smaller.
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}
SIZES = {"num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size"}


def _write_llama_3_2(path: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    path.mkdir(parents=True)
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))


def _commands(text: str, prefix: str) -> list[list[str]]:
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    return [line.split()[1:] for line in lines if line.startswith(prefix)]


def _megacli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    from tests.conftest import megacli_here

    return megacli_here(*args, cwd=cwd)


@pytest.mark.slow
def test_docs_and_sft_recipe_commands_run_on_a_llama_3_2_config(tmp_path):
    docs = [c for c in _commands(PAGE.read_text(), "megacli convert hf/Llama-3.2-1B")]
    recipe_text = RECIPE.read_text()
    header = _commands("\n".join(line.lstrip("# ") for line in recipe_text.splitlines() if line.startswith("#")), "megacli ")
    assert len(docs) == 1 and [c[0] for c in header] == ["convert", "finetune"], (docs, header)
    _write_llama_3_2(tmp_path / "hf" / "Llama-3.2-1B")
    shutil.copytree(tmp_path / "hf" / "Llama-3.2-1B", tmp_path / header[0][1])
    (tmp_path / "recipes").mkdir()
    shutil.copy(RECIPE, tmp_path / "recipes" / RECIPE.name)
    (tmp_path / "my_instructions.jsonl").write_text('{"prompt": "hi", "response": "hello"}\n')

    for args in (docs[0], header[0]):
        done = _megacli(args, tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
    converted = yaml.safe_load((tmp_path / header[0][2] / "iter_0000000" / "recipe.yaml").read_text())["model"]
    converted["rope_scaling"] = {k: v for k, v in converted["rope_scaling"].items() if v is not None}  # unset fields
    shipped = yaml.safe_load(recipe_text)["model"]
    assert {k: v for k, v in shipped.items() if k not in SIZES} == {k: converted[k] for k in shipped if k not in SIZES}

    done = _megacli([*header[1], "--dry-run"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "layout" in done.stdout
