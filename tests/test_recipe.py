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
    assert (r.world_size, r.data_parallel_size, r.num_microbatches, r.layers_per_stage) == (8, 2, 8, [4, 4])
    assert r.tokens_per_step == 32 * 1024


def test_uneven_stages_split_as_megatron_core():
    r = load(["launch.nproc=4", "parallel.pipeline=4", "model.num_layers=26", "parallel.first_stage_layers=5"])
    assert r.layers_per_stage == [5, 7, 7, 7]
    assert r.model_dump()["parallel"]["last_stage_layers"] is None  # nothing derived is stored
    r = load(["launch.nproc=3", "parallel.pipeline=3", "parallel.virtual_pipeline=2", "model.num_layers=10",
              "parallel.first_stage_layers=2", "parallel.last_stage_layers=4", "train.global_batch_size=24"])
    assert r.layers_per_stage == [2, 4, 4]
    # chunk 0 of every stage, then chunk 1 (Megatron-Core's layer offsets)
    assert [[list(c) for c in s] for s in r.parallel.chunk_layers(10)] == [[[0], [5]], [[1, 2], [6, 7]], [[3, 4], [8, 9]]]


@pytest.mark.parametrize("overrides, field, words", [
    (["parallel.tensor=5"], "parallel.tensor = 5", "num_attention_heads = 12"),
    (["model.num_query_groups=5"], "model.num_query_groups = 5", "must divide"),
    (["model.num_query_groups=2", "parallel.tensor=4", "launch.nproc=4", "train.global_batch_size=32"], "parallel.tensor = 4", "num_query_groups = 2"),
    (["parallel.pipeline=5", "launch.nproc=5"], "model.num_layers = 12", "12 % 5 = 2"),
    (["parallel.pipeline=2", "parallel.virtual_pipeline=4", "launch.nproc=2"], "model.num_layers = 12", "= 8"),
    (["model.num_layers=3", "parallel.pipeline=2", "launch.nproc=2"], "model.num_layers = 3",
     "parallel.first_stage_layers = 1 (stages of 1, 2 layers)"),
    (["model.num_layers=3", "parallel.pipeline=2", "launch.nproc=2", "parallel.first_stage_layers=3"],
     "parallel.first_stage_layers = 3", "3 layers on the uneven stage leave 0 for 1 other stage"),
    (["model.num_layers=10", "parallel.pipeline=4", "launch.nproc=4", "parallel.first_stage_layers=2"],
     "parallel.first_stage_layers = 2", "10 - 2 = 8 layers must divide evenly over the 3 other stages (8 % 3 = 2)"),
    (["model.num_layers=10", "parallel.pipeline=3", "parallel.virtual_pipeline=2", "launch.nproc=3",
      "parallel.first_stage_layers=3", "train.global_batch_size=24"], "parallel.first_stage_layers = 3",
     "must be divisible by parallel.virtual_pipeline = 2"),
    (["model.num_layers=12", "parallel.pipeline=3", "parallel.virtual_pipeline=2", "launch.nproc=3",
      "parallel.first_stage_layers=2", "train.global_batch_size=24"], "parallel.first_stage_layers = 2",
     "12 - 2 = 10 layers must divide evenly over the 2 other stages × parallel.virtual_pipeline 2 (10 % 4 = 2)"),
    (["parallel.first_stage_layers=1"], "parallel.first_stage_layers = 1", "need parallel.pipeline >= 2"),
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


@pytest.mark.parametrize("overrides, enabled", [
    ([], False),
    (["parallel.tensor=2", "launch.nproc=2"], True),
    (["parallel.tensor=2", "launch.nproc=2", "parallel.sequence_parallel=false"], False),
    (["parallel.tensor=2", "launch.nproc=2", "parallel.sequence_parallel=true"], True),
])
def test_sequence_parallel_auto_is_on_exactly_with_tensor_parallelism(overrides, enabled):
    r = load(overrides)
    assert r.parallel.sp_enabled is enabled
    assert r.parallel.sequence_parallel == ("auto" if not any("sequence" in o for o in overrides) else enabled)


def test_warmup_fraction_follows_the_decay_horizon_and_warmup_iters_wins():
    r = load(["optim.warmup_fraction=0.1", "train.iters=300"])
    assert r.optim.warmup_steps(r.train.iters) == 30
    r = load(["optim.warmup_fraction=0.1", "train.iters=4"])
    assert r.optim.warmup_steps(r.train.iters) == 0
    r = load(["optim.warmup_fraction=0.1", "train.iters=300", "optim.decay_iters=100"])
    assert r.optim.warmup_steps(r.train.iters) == 10
    r = load(["optim.warmup_fraction=0.1", "optim.warmup_iters=5"])
    assert r.optim.warmup_steps(r.train.iters) == 5
    assert load([]).optim.warmup_steps(1000) == 0
    # An explicit warmup_iters keeps its check.
    assert "must be shorter than the decay horizon" in problem(["optim.warmup_iters=30", "train.iters=4"])
    assert "optim.warmup_fraction = 1" in problem(["optim.warmup_fraction=1"])


def test_mock_data_wins_over_a_path_and_a_path_or_blend_is_needed_without_it():
    r = load([], {"data": {"path": "data/corpus_text_document"}})
    assert r.data.prefixes == ["data/corpus_text_document"]
    r = load(["data.mock=true"], {"data": {"path": "data/corpus_text_document"}})
    assert r.data.mock and r.data.prefixes == [] and r.data.path == "data/corpus_text_document"
    assert "the recipe names no training data" in problem(["data.mock=false"])
    assert "not both" in problem(["data.path=a", "data.blend=[[1, b]]"])


@pytest.mark.parametrize("spelling", ["tokenizer.type=none", "tokenizer.type=null", "tokenizer.type='null'"])
def test_tokenizer_type_none_and_its_old_spelling_null(spelling):
    r = load([spelling, "model.vocab_size=1000"])
    assert r.tokenizer.type == "none"
    assert "tokenizer.type: none needs an explicit model.vocab_size" in problem([spelling])


def test_tokenizer_type_none_holds_model_vocab_size_ids_end_of_document_included():
    """model.vocab_size rows hold every id NullTokenizer makes (it appends the end-of-document id),
    as Megatron-LM's --vocab-size V builds a V + 1 vocabulary."""
    from megacli.data.tokenizers import load_tokenizer
    from megacli.errors import UserError

    tok = load_tokenizer(type="none", path=None, vocab_size=256)
    assert (tok.vocab_size, tok.eod) == (256, 255)
    assert tok.encode_batch(["0 254"]) == [[0, 254]]
    with pytest.raises(ValueError, match="outside"):
        tok.encode_batch(["256"])
    with pytest.raises(UserError, match="model.vocab_size"):
        load_tokenizer(type="none", path=None, vocab_size=1)


def test_tokenizer_type_null_in_a_file_is_none(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("tokenizer:\n  type: null\nmodel:\n  vocab_size: 1000\ndata:\n  mock: true\n")
    assert base.load(TrainingRecipe, path).tokenizer.type == "none"


@pytest.mark.parametrize("value", ["0", "null"])
def test_zero_or_null_interval_means_never(value):
    r = load([f"train.eval_interval={value}", f"checkpoint.save_interval={value}"])
    assert not r.train.eval_interval and not r.checkpoint.save_interval
    assert "train.eval_interval = -1" in problem(["train.eval_interval=-1"])


def test_checkpoint_recipes_resolve_sequence_parallel_auto_for_the_target_layout():
    from megacli.recipe.sections import sequence_parallel_on
    from megacli.reshard.tensor_plan import Layout, resolve_target

    assert sequence_parallel_on("auto", tensor=2) and not sequence_parallel_on("auto", tensor=1)
    src = Layout(tensor=1, data=2)
    assert resolve_target(src, {"sequence_parallel": "auto"}, tensor=2).sequence_parallel
    assert not resolve_target(src, {"sequence_parallel": "auto"}).sequence_parallel
    assert not resolve_target(src, {"sequence_parallel": False}, tensor=2).sequence_parallel


@pytest.mark.parametrize("overrides, field, words", [
    (["optim.lr=inf"], "optim.lr", "finite number"),
    (["optim.lr=.nan"], "optim.lr", "finite number"),
    (["optim.clip_grad=-.inf"], "optim.clip_grad", "finite number"),
    (["train.iters=true"], "train.iters = True", "expected a number, not true/false"),
    (["data.blend=[[true, a], [1, b]]"], "data.blend", "not true/false"),
])
def test_numbers_are_finite_and_never_true_or_false(overrides, field, words):
    msg = problem(overrides)
    assert field in msg and words in msg, msg


def test_a_key_given_twice_in_a_recipe_is_refused_naming_file_line_and_key(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  iters: 5\n  micro_batch_size: 1\n  iters: 7\n")
    with pytest.raises(RecipeErrors) as info:
        base.load(TrainingRecipe, path)
    assert str(path) in info.value.render() and "line 4" in info.value.render() and "'iters'" in info.value.render()


def test_a_yaml_merge_may_override_the_keys_it_brings(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("train: &t\n  iters: 5\nfinetune_like:\n  <<: *t\n  iters: 7\n")
    assert base.read_yaml(path)["finetune_like"] == {"iters": 7}


@pytest.mark.parametrize("override", ["data.files=[a.jsonl", "run.name='abc", "train.iters={a: 1, a: 2}"])
def test_an_unterminated_or_doubled_set_value_is_a_yaml_error(override):
    msg = problem([override])
    assert "--set" in msg and override in msg and "should be a valid" not in msg, msg


def test_a_set_value_with_a_colon_inside_stays_text():
    assert base.parse_override("run.name=a: b: c")[1] == "a: b: c"


def test_data_source_null_is_the_default_indexed_source():
    assert load(["data.source=null", "data.mock=true"]).data.source == "indexed"
