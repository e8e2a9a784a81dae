"""`megacli pretrain --dry-run` counts the parameters of the model the engine builds: GPT, BERT
(token types, LM head, pooler and binary head, output bias; pre- and post-LN) and T5 (decoder layers with
cross-attention, two final norms, relative position biases, the tied LM head's bias). The
reference is the real Megatron-Core model, built on CPU in one process."""

from __future__ import annotations

import os
import re

TINY = ["data.mock=false", "data.path=x", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.ffn_hidden_size=96", "model.seq_length=64", "model.vocab_size=200", "launch.nproc=1", "parallel.tensor=1",
        "parallel.pipeline=1", "parallel.sequence_parallel=false", "launch.device=cpu"]
CASES = {
    "gpt": ["model.activation=swiglu", "model.untie_embeddings=true", "model.num_query_groups=2", "model.qk_layernorm=true",
            "model.add_bias_linear=false", "model.normalization=rmsnorm", "model.position_embedding=rope"],
    "bert": ["model.arch=bert"],
    "bert_untied_no_binary_head": ["model.arch=bert", "model.bert_binary_head=false", "model.untie_embeddings=true",
                                   "model.normalization=rmsnorm"],
    "bert_post_ln_masked_lm": ["model.arch=bert", "model.norm_position=post", "model.bert_binary_head=false",
                               "model.bert_token_types=2", "model.activation=gelu_tanh"],
    "t5": ["model.arch=t5", "model.decoder_num_layers=3", "model.position_embedding=relative", "model.decoder_seq_length=24"],
    "t5_untied_learned_swiglu": ["model.arch=t5", "model.untie_embeddings=true", "model.activation=swiglu",
                                 "model.add_bias_linear=false", "model.decoder_seq_length=24"],
}


def _recipe(case: str):
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    return base.load(TrainingRecipe, None, [*TINY, *CASES[case]])


def _built_params(rank, world_size) -> dict[str, int]:
    from megacli.engine import distributed
    from megacli.engine.models import build_model
    from megacli.engine.models.config import transformer_config

    counts = {}
    for i, case in enumerate(CASES):
        recipe = _recipe(case)
        if i == 0:
            distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=1)
        config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="fp32", on_cuda=False)
        chunks = build_model(recipe=recipe, config=config, vocab_size=recipe.model.vocab_size)
        counts[case] = sum(p.numel() for c in chunks for p in c.parameters())
    distributed.teardown()
    return counts


def test_dry_run_parameter_count_is_the_built_models(tmp_path):
    from typer.testing import CliRunner

    from megacli.cli import _register, app
    from megacli.recipe.base import dump
    from tests._dist import spawn

    built = spawn(_built_params, 1)[0]
    _register()
    for case in CASES:
        recipe = tmp_path / f"{case}.yaml"
        recipe.write_text(dump(_recipe(case)))
        res = CliRunner().invoke(app, ["pretrain", str(recipe), "--dry-run"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output[-2000:]
        shown = re.search(r"parameters \(model\)\s*│\s*([\d,]+)", res.stdout)
        assert shown, res.stdout[-2000:]
        assert int(shown.group(1).replace(",", "")) == built[case], (case, shown.group(1), built[case])


def test_t5_vocabulary_counts_the_sentinels_the_tokenizer_lacks():
    from megacli.data.tokenizers import ByteTokenizer
    from megacli.plan import count_params, model_vocab_size

    class WithSentinels(ByteTokenizer):  # a tokenizer that already has <extra_id_0..9>
        def vocabulary(self):
            return {**super().vocabulary(), **{self.vocab_size + k: f"<extra_id_{k}>" for k in range(10)}}

    recipe = _recipe("t5")
    tok = ByteTokenizer()
    assert model_vocab_size(recipe, tok) == 200  # model.vocab_size wins
    plain = recipe.model_copy(update={"model": recipe.model.model_copy(update={"vocab_size": None})})
    sentinels = recipe.masking.sentinel_tokens
    assert model_vocab_size(plain, tok) == tok.vocab_size + sentinels
    assert model_vocab_size(plain, WithSentinels()) == tok.vocab_size + sentinels - 10
    # the byte vocabulary + 100 sentinels pad to 384 rows: a tied T5 LM head keeps one bias per row.
    assert count_params(plain, model_vocab_size(plain, tok)).output_layer == 384
    bert = _recipe("bert").model_copy(update={"model": _recipe("bert").model.model_copy(update={"vocab_size": None})})
    assert model_vocab_size(bert, tok) == tok.vocab_size


def _load(overrides):
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    return base.load(TrainingRecipe, None, [*TINY, *overrides])


def test_attention_kernel_follows_device_precision_masks_and_dropout():
    from megacli.plan import attention_kernel

    def kernel(overrides, device):
        return attention_kernel(_load(overrides), device=device)

    assert kernel(["train.precision=bf16"], "cuda") == "flash"
    assert kernel(["train.precision=fp32"], "cuda") == "memory-efficient"
    assert kernel(["train.precision=bf16", "model.position_embedding=alibi"], "cuda") == "memory-efficient"
    assert kernel(["train.precision=bf16", *CASES["bert"]], "cuda") == "memory-efficient"
    assert kernel(["train.precision=bf16", "model.kv_channels=20"], "cuda") == "math"
    assert kernel([], "cpu") == "flash"
    assert kernel(["model.attention_dropout=0.1"], "cpu") == "math"
    assert kernel(["parallel.context=2", "launch.nproc=2"], "cpu") == "ring"


def test_activations_hold_the_attention_scores_only_for_the_math_kernel():
    from megacli.plan import activation_bytes_per_layer

    r = _load(["train.precision=bf16", "train.micro_batch_size=2", "model.dropout=0.1"])
    s, b, h, a = 64, 2, 64, 4
    assert activation_bytes_per_layer(r, kernel="flash") == s * b * h * 34
    assert activation_bytes_per_layer(r, kernel="math") == s * b * h * (34 + 5 * a * s / h)
    # Without hidden dropout its two masks (1 byte per element on CUDA, 2 on CPU) are not kept.
    no_dropout = _load(["train.precision=bf16", "train.micro_batch_size=2", "model.dropout=0"])
    assert activation_bytes_per_layer(no_dropout, kernel="flash") == s * b * h * 32
    assert activation_bytes_per_layer(r, kernel="flash", device="cpu") == s * b * h * 36


def test_dry_run_names_the_kernel_and_the_estimate_follows_it():
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    sets = [x for s in [*TINY, "model.seq_length=1024", "train.precision=fp32"] for x in ("--set", s)]
    flash = CliRunner().invoke(app, ["pretrain", "--dry-run", *sets])
    math = CliRunner().invoke(app, ["pretrain", "--dry-run", *sets, "--set", "model.attention_dropout=0.1"])
    assert flash.exit_code == 0 and math.exit_code == 0, flash.output + math.output
    assert "flash on cpu" in flash.output and "math on cpu" in math.output

    def activations(text):
        return float(re.search(r"activations\s*│\s*([\d.]+)", text).group(1))

    assert activations(math.output) > 2 * activations(flash.output)  # 5as/h = 320 against 34 at s = 1024


def test_dry_run_recipe_is_whole_block_yaml_when_not_on_a_terminal():
    import yaml
    from typer.testing import CliRunner

    from megacli.cli import _register, app
    from megacli.recipe.jobs import repo_recipes_dir
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    _register()
    name = "a-run-name-" + "x" * 150
    out = CliRunner().invoke(app, ["pretrain", str(repo_recipes_dir() / "gpt2_1.3b.yaml"), "--dry-run",
                                   "--set", f"run.name={name}"])
    assert out.exit_code == 0, out.output
    printed = out.output[: out.output.index(" layout ")]
    recipe = base.load(TrainingRecipe, repo_recipes_dir() / "gpt2_1.3b.yaml", [f"run.name={name}"])
    assert yaml.safe_load(printed) == recipe.model_dump(mode="json")
    assert printed.startswith("model:\n  arch: gpt\n") and f"  name: {name}\n" in printed


WORKER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_first_step_line_states_measured_peak_memory_and_intervals_of_0_mean_never(tmp_path, monkeypatch):
    """A one-process run on CPU: the memory line follows the first step line; eval_interval 0 never
    evaluates, save_interval 0 saves only at the end."""
    import json

    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    monkeypatch.setenv("MEGACLI_IN_PROCESS", "1")
    sets = ["data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null", "model.num_layers=2",
            "model.hidden_size=32", "model.num_attention_heads=2", "model.seq_length=32", "launch.nproc=1",
            "parallel.tensor=1", "parallel.pipeline=1", "launch.device=cpu", "train.iters=2", "train.micro_batch_size=2",
            "train.global_batch_size=2", "train.log_interval=1", "train.precision=fp32", "train.eval_interval=0",
            "checkpoint.save_interval=0", f"checkpoint.dir={tmp_path / 'ck'}", f"run.dir={tmp_path / 'run'}"]
    env_before = {k: os.environ.get(k) for k in WORKER_VARS}
    out = CliRunner().invoke(app, ["pretrain", *[x for s in sets for x in ("--set", s)]])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())  # the console wraps long lines at 80 columns here
    steps = re.split(r"iter +\d+ \|", text)  # (a wrapped tmp path may hold "iter " too)
    assert len(steps) == 3 and text.count("memory: ") == 1, text
    assert re.search(r"GiB memory: peak RSS [\d.]+ GiB \(measured.*\| estimate [\d.]+ GiB .*flash attention", steps[1]), text
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not any("val_loss" in r for r in records)
    assert sorted(p.name for p in (tmp_path / "ck").glob("iter_*")) == ["iter_0000002"]
    # The in-process worker's env:// variables are restored: a job started next (a subprocess
    # inheriting this environment) must not take itself for a worker of this one.
    assert {k: os.environ.get(k) for k in WORKER_VARS} == env_before


def test_dry_run_says_what_auto_and_warmup_fraction_resolve_to():
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    out = CliRunner().invoke(app, ["pretrain", "--dry-run", "--set", "train.iters=50"])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.replace("│", " ").split())
    assert "sequence parallelism on (auto: TP 2)" in text
    assert "learning-rate warmup 5 steps (optim.warmup_fraction 0.1 of 50), then cosine decay" in text
    out = CliRunner().invoke(app, ["pretrain", "--dry-run", "--set", "parallel.tensor=1", "--set", "optim.warmup_iters=3"])
    text = " ".join(out.output.replace("│", " ").split())
    assert "sequence parallelism off (auto: TP 1)" in text and "3 steps (optim.warmup_iters)" in text


def test_dry_run_lists_uneven_stages_and_estimates_the_busiest():
    from typer.testing import CliRunner

    from megacli import plan
    from megacli.cli import _register, app
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    _register()
    uneven = ["model.num_layers=7", "parallel.pipeline=4", "launch.nproc=4", "parallel.last_stage_layers=1",
              "train.global_batch_size=8", "model.vocab_size=50000"]
    sets = [x for s in [*TINY, *uneven] for x in ("--set", s)]
    out = CliRunner().invoke(app, ["pretrain", "--dry-run", *sets], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "[2, 2, 2, 1] (uneven: parallel.last_stage_layers = 1)" in out.output
    recipe = base.load(TrainingRecipe, None, [*TINY, *uneven])
    counts, mem = plan.estimate(recipe, 50000, device="cpu")
    stages = [plan.stage_memory(recipe, counts, 50000, s, device="cpu") for s in range(4)]
    assert mem.total_gib == max(s.total_gib for s in stages)
    # the last stage: one layer, but the output layer and the logits of a 50k vocabulary
    assert mem.stage == 3 and mem.logits_gib > 0 and stages[0].logits_gib == 0
    assert "pipeline stage 3 of 4, the busiest" in out.output


def test_flops_count_each_layers_attention_span_and_widths():
    """6·N + 12·L·h·s for plain attention; a windowed layer attends over its window; heads × head_dim
    (not hidden) is the attention width; MLA's query-key and value widths differ."""
    from megacli.plan import flops_per_token

    s, h, L = 64, 64, 2
    assert flops_per_token(_load([]), 1000) == 6 * 1000 + 12 * L * h * s
    windowed = _load(["model.position_embedding=rope", "model.sliding_window=16", "model.sliding_window_layers=2"])
    assert windowed.model.window_layers() == [1, 0]
    assert flops_per_token(windowed, 0) == 6 * (16 + s) * 2 * h
    wide = _load(["model.kv_channels=32"])  # 4 heads × 32 = 128 wide, hidden 64
    assert flops_per_token(wide, 0) == 12 * L * 128 * s
    mla = _load(["model.position_embedding=rope", "model.add_bias_linear=false", "model.normalization=rmsnorm",
                 "model.mla.kv_lora_rank=16", "model.mla.qk_head_dim=8", "model.mla.qk_pos_emb_head_dim=4",
                 "model.mla.v_head_dim=8"])
    assert flops_per_token(mla, 0) == 6 * L * s * 4 * ((8 + 4) + 8)


def test_cuda_fuses_the_bias_activation_only_where_the_fused_kernel_is_the_same_function():
    """Megatron-Core's fused bias-GeLU and bias-GeGLU (megatron/core/fusions/fused_bias_gelu.py,
    fused_bias_geglu.py) compute the tanh approximation: on CUDA they serve gelu_tanh and geglu (the
    same function) in a GPT's dense MLP, never exact GeLU; SwiGLU's fused kernel is exact. The tanh
    kernels are selected by activation_func F.gelu, so the config carries it only where fused."""
    import torch.nn.functional as F

    from megacli.engine.models.config import transformer_config
    from megacli.recipe.model import ModelSection
    from megacli.recipe.sections import ParallelSection

    def config(**model):
        return transformer_config(model=ModelSection(add_bias_linear=True, **model), parallel=ParallelSection(),
                                  precision="fp32", on_cuda=True)

    fused = {a: config(activation=a).bias_activation_fusion for a in ("gelu", "gelu_tanh", "geglu", "swiglu", "squared_relu")}
    assert fused == {"gelu": False, "gelu_tanh": True, "geglu": True, "swiglu": True, "squared_relu": False}
    assert config(activation="gelu_tanh").activation_func is F.gelu
    assert config(activation="gelu").activation_func is F.gelu  # exact GeLU, unfused
    assert config(activation="gelu_tanh", arch="bert").activation_func is not F.gelu  # BERT's head calls it unfused
    assert not config(activation="gelu_tanh", arch="bert").bias_activation_fusion
