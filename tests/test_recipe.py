"""Recipe validation: shipped recipes validate, every field is documented, bad values give one
message naming the field, the value and the arithmetic."""

from pathlib import Path

import pytest
import yaml

from megacli.recipe import base
from megacli.recipe.base import RecipeErrors
from megacli.recipe.jobs import recipe_model
from megacli.recipe.pretrain import TrainingRecipe

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


def job_of(path: Path) -> str:
    name = path.stem
    if name.startswith("preprocess"):
        return "preprocess"
    if name.startswith("sft"):
        return "finetune"
    return "pretrain"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    try:
        model = recipe_model(job_of(path))
    except ValueError:
        pytest.skip(f"no recipe model for {job_of(path)} in this version")
    recipe = base.load(model, path)
    # The resolved recipe round-trips: dumping and re-validating gives the same recipe.
    assert base.validate(model, yaml.safe_load(base.dump(recipe)), "dump") == recipe


def _all_sections(model, seen=None):
    seen = seen if seen is not None else set()
    if model in seen:
        return seen
    seen.add(model)
    for field in model.model_fields.values():
        ann = field.annotation
        for cand in (ann, *getattr(ann, "__args__", ())):
            if isinstance(cand, type) and issubclass(cand, base.Section):
                _all_sections(cand, seen)
    return seen


def test_every_field_has_a_description():
    for section in _all_sections(TrainingRecipe):
        for name, field in section.model_fields.items():
            assert field.description, f"{section.__name__}.{name} has no description"


def load(overrides, raw=None):
    return base.load(TrainingRecipe, None, overrides, default=raw or {"data": {"mock": True}})


def problem(overrides, raw=None) -> str:
    with pytest.raises(RecipeErrors) as info:
        load(overrides, raw)
    return info.value.render()


def test_defaults_are_a_valid_recipe():
    r = load([])
    assert r.data_parallel_size == 1 and r.num_microbatches == 8


def test_derived_numbers():
    r = load(["launch.nproc=8", "parallel.tensor=2", "parallel.pipeline=2", "train.global_batch_size=32",
              "train.micro_batch_size=2", "model.num_layers=8"])
    assert (r.world_size, r.data_parallel_size, r.num_microbatches, r.layers_per_stage) == (8, 2, 8, 4)
    assert r.tokens_per_step == 32 * 1024


@pytest.mark.parametrize("overrides, field, words", [
    (["parallel.tensor=5"], "parallel.tensor = 5", "num_attention_heads = 12"),
    (["model.num_query_groups=5"], "model.num_query_groups = 5", "must divide"),
    (["model.num_query_groups=2", "parallel.tensor=4", "launch.nproc=4", "train.global_batch_size=32"], "parallel.tensor = 4", "num_query_groups = 2"),
    (["parallel.pipeline=5", "launch.nproc=5"], "model.num_layers = 12", "12 % 5 = 2"),
    (["parallel.pipeline=2", "parallel.virtual_pipeline=4", "launch.nproc=2"], "model.num_layers = 12", "= 8"),
    (["launch.nproc=3", "parallel.tensor=2"], "launch.nproc = 3", "multiple of"),
    (["train.global_batch_size=30", "launch.nproc=4"], "train.global_batch_size = 30", "4 × 4 = 16"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel = True", "parallel.tensor > 1"),
    (["parallel.context=2", "launch.nproc=2", "model.seq_length=1026"], "model.seq_length = 1026", "2 × parallel.context = 4"),
    (["optim.min_lr=1", "optim.lr=0.1"], "optim", "above"),
    (["model.hidden_sise=3"], "model.hidden_sise", "did you mean model.hidden_size"),
    (["train.precision=fp8"], "train.precision = 'fp8'", "fp32"),
    (["model.num_layers=0"], "model.num_layers = 0", "greater than 0"),
    (["data.split=a,b"], "data.split = 'a,b'", "comma-separated"),
    (["tokenizer.type=huggingface"], "tokenizer", "needs tokenizer.path"),
])
def test_bad_values_name_field_value_and_reason(overrides, field, words):
    msg = problem(overrides)
    assert field in msg and words in msg, msg


def test_override_parses_yaml_values_and_creates_sections():
    r = load(["model.dropout=0.1", "data.blend=[[0.3, a], [0.7, b]]", "data.mock=false"])
    assert r.model.dropout == 0.1 and r.data.prefixes == ["a", "b"]


def test_bad_override_syntax():
    assert "dotted.key=value" in problem(["model.hidden_size"])


def test_validation_does_not_mutate_and_sections_are_frozen():
    raw = {"model": {"num_layers": 4}, "data": {"mock": True}}
    r = base.validate(TrainingRecipe, raw, "x")
    assert raw == {"model": {"num_layers": 4}, "data": {"mock": True}}
    with pytest.raises(Exception):
        r.model.num_layers = 8


def test_yaml_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: [1,\n")
    with pytest.raises(RecipeErrors) as info:
        base.load(TrainingRecipe, bad)
    assert str(bad) in info.value.render() and "line" in info.value.render()
