"""`megacli recipe from` (issue 31): the recipe that reproduces a checkpoint, and tables that fit
when the output is a pipe or a file.

One tiny run (one worker, in-process), 4 steps with a checkpoint at 2, exported with megacli's own
Megatron-LM writer (`reshard --format megatron`, and `--format legacy`). Resuming the Megatron-LM
checkpoint "in place" is then two commands: `megacli recipe from MLM -o run.yaml`, then
`megacli pretrain run.yaml --set data.mock=true --set checkpoint.resume=MLM`; its losses must equal
those of resuming with the hand-written recipe (and continue the original run).
"""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from megacli.checkpoint.source import Source

from tests.conftest import pretrain_losses
from tests.test_megatron_lm_resume import TINY, TOL

SINGLE = ["parallel.tensor=1", "parallel.pipeline=1", "parallel.distributed_optimizer=false", "launch.nproc=1"]


def cli(*args):
    from megacli.cli import _register, app

    _register()
    return CliRunner().invoke(app, [str(a) for a in args])


def sets(*items: str) -> list[str]:
    return [x for s in items for x in ("--set", s)]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_from")
    res, losses = pretrain_losses(sets(*TINY, *SINGLE, f"checkpoint.dir={root / 'ck'}", "checkpoint.save_interval=2"),
                                  root / "run_a", in_process=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    for fmt in ("megatron", "legacy"):
        res = cli("reshard", root / "ck" / "iter_0000002", root / fmt, "--format", fmt)
        assert res.exit_code == 0, res.output
    return root, losses


def test_recipe_from_then_pretrain_resumes_a_megatron_lm_checkpoint_in_place(chain):
    root, original = chain
    mlm, recipe = root / "megatron", root / "run.yaml"
    res = cli("recipe", "from", mlm, "-o", recipe)
    assert res.exit_code == 0, res.output
    text = recipe.read_text()
    assert text.startswith("# yaml-language-server: $schema=") and "Megatron-LM torch_dist checkpoint" in text
    assert f"--set checkpoint.resume={mlm}" in text  # what to pass, in the header
    # megacli's byte tokenizer is written as Megatron-LM's NullTokenizer, which has no files to name:
    # the one thing the header lists as not mapped, and the one thing set besides data and resume.
    header = [line for line in text.splitlines() if line.startswith("#")]
    not_mapped = header[header.index("# Not mapped (the checkpoint's run has these; this recipe does not):") + 1:
                        header.index("# Before running:")]
    assert not_mapped == ["#   - tokenizer NullTokenizer; set tokenizer.type and tokenizer.path"], header
    got_res, got = pretrain_losses([str(recipe), *sets("data.mock=true", "tokenizer.type=byte", f"checkpoint.resume={mlm}",
                                                       f"checkpoint.dir={root / 'ck_from'}")],
                                   root / "run_from", in_process=True)
    assert got_res.returncode == 0, got_res.stdout[-2000:] + got_res.stderr[-3000:]
    hand_res, hand = pretrain_losses(sets(*TINY, *SINGLE, f"checkpoint.resume={mlm}", f"checkpoint.dir={root / 'ck_hand'}"),
                                     root / "run_hand", in_process=True)
    assert hand_res.returncode == 0, hand_res.stdout[-2000:] + hand_res.stderr[-3000:]
    assert sorted(got) == sorted(hand) == [3, 4], (got, hand)
    assert got == hand
    for step in (3, 4):  # and both continue the run the checkpoint came from
        assert abs(got[step] - original[step]) <= TOL, (step, got[step], original[step])
    assert "at iteration 2" in got_res.stdout + got_res.stderr


def test_recipe_from_reads_every_checkpoint_kind(chain, tmp_path):
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    root, _ = chain
    stored = load(TrainingRecipe, root / "ck" / "iter_0000002" / "recipe.yaml")
    res = cli("recipe", "from", root / "ck")  # a megacli run's checkpoint directory: its own recipe
    assert res.exit_code == 0, res.output
    assert load(TrainingRecipe, _saved(tmp_path / "megacli.yaml", res.output)) == stored
    for fmt in ("megatron", "legacy"):  # the args mapped back: the same model, layout and schedule
        res = cli("recipe", "from", root / fmt)
        assert res.exit_code == 0, res.output
        got = load(TrainingRecipe, _saved(tmp_path / f"{fmt}.yaml", res.output))
        # Fields the args give explicitly where the run left them derived: compared by what they give.
        explicit = {"model": {"max_position_embeddings", "vocab_size"}, "parallel": {"sequence_parallel"},
                    "optim": {"warmup_fraction", "decay_iters"}}
        for section, fields in explicit.items():
            assert getattr(got, section).model_dump(exclude=fields) == getattr(stored, section).model_dump(exclude=fields)
        assert (got.model.max_positions, got.model.vocab_size) == (stored.model.max_positions, 262)
        assert got.parallel.sp_enabled == stored.parallel.sp_enabled
        assert [(o.warmup_steps(4), o.decay_horizon(4)) for o in (got.optim, stored.optim)] == [(1, 4)] * 2
        for field in ("iters", "global_batch_size", "micro_batch_size", "seed", "eval_interval", "log_interval"):
            assert getattr(got.train, field) == getattr(stored.train, field), (fmt, field)
        assert (got.data.split, got.checkpoint.save_interval) == (stored.data.split, stored.checkpoint.save_interval)


def test_recipe_from_a_hugging_face_directory(tmp_path):
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe
    from tests._convert_models import build_hf

    build_hf("llama_untied_gqa", tmp_path / "hf", with_tokenizer=True)
    res = cli("recipe", "from", tmp_path / "hf")
    assert res.exit_code == 0, res.output
    assert "megacli convert" in res.output  # the weights are converted first
    got = load(TrainingRecipe, _saved(tmp_path / "hf.yaml", res.output))
    m = got.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels, m.ffn_hidden_size,
            m.activation, m.normalization, m.position_embedding, m.untie_embeddings) == \
        (2, 32, 4, 2, 16, 64, "swiglu", "rmsnorm", "rope", True)
    assert got.tokenizer.type == "huggingface" and got.tokenizer.path == str(tmp_path / "hf")


def test_recipe_from_refuses_to_overwrite_and_names_bad_input(chain, tmp_path):
    root, _ = chain
    out = tmp_path / "run.yaml"
    out.write_text("mine\n")
    res = cli("recipe", "from", root / "megatron", "-o", out)
    assert res.exit_code == 2 and "exists; pass --force" in res.output and out.read_text() == "mine\n"
    res = cli("recipe", "from", root / "megatron", "-o", out, "--force")
    assert res.exit_code == 0 and yaml.safe_load(out.read_text())["model"]["num_layers"] == 2
    res = cli("recipe", "from", tmp_path / "nothing", "-o", tmp_path / "new.yaml")
    assert res.exit_code == 2 and "no such checkpoint" in res.output and not (tmp_path / "new.yaml").exists()
    assert "Traceback" not in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # no temporary file left


def test_reshard_inspect_tables_keep_tensor_names_whole_in_a_pipe(chain):
    """CliRunner's output is not a terminal (rich would assume 80 columns): every tensor name and
    the checkpoint path sit whole on one line."""
    from megacli.checkpoint.contents import inspect

    root, _ = chain
    for ckpt in (root / "ck" / "iter_0000002", root / "megatron"):
        res = cli("reshard", "inspect", ckpt)
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        names = [t["name"] for t in inspect(Source(ckpt))["tensors"] if t["kind"] == "model"]
        assert names and all(any(name in line for line in lines) for name in names), res.output
        assert any(str(ckpt) in line for line in lines), res.output


def _saved(path, text: str):
    path.write_text(text)
    return path


def test_args_the_recipe_does_not_give_back_are_listed():
    from megacli.checkpoint.megatron_lm.args import args_not_reproduced
    from megacli.checkpoint.megatron_lm.args_namespace import megatron_args
    from tests.test_megatron_lm_write import recipe

    r = recipe()
    args = megatron_args(r, vocab_size=262)
    assert args_not_reproduced(args, r) == []
    args.split, args.reset_attention_mask = "90, 5, 5", True
    assert args_not_reproduced(args, r) == ["--split '90, 5, 5' (the recipe's data.split gives '969,30,1')",
                                            "--reset-attention-mask True (the recipe's data.reset_attention_mask gives False)"]
