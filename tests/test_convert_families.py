"""Issue #19's families against Hugging Face, tiny random models built from config dicts with their
released configs' features on (tests/_convert_models.FAMILY_MODELS): Qwen3-MoE, OLMo 2 and
Phi-4-mini (Phi-3). Each has 3 layers, so PP=2 is an uneven split that convert picks.

Checked: HF -> megacli (prepared for TP=2 × PP=2) -> HF is bitwise with the same config.json;
logits within 1e-4 of HF at TP=1 and at TP=2 × PP=2 (Qwen3-MoE with the sequence parallelism
Megatron's MoE layers need, and at EP=2); greedy generation equals HF's `generate` at TP=1 and
TP=2 × PP=2 (Qwen3-MoE at TP=1: generation runs one replica, and a MoE at TP > 1 needs sequence
parallelism, which decoding does not have); at TP=2 × PP=2 the training gradients of OLMo 2's norms (q/k norms over the whole
projection, split over TP with the sum of squares all-reduced; the output norms) equal HF's.
Plus the refusals: Phi-3's longrope, and the recipe fields' validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from megacli.checkpoint.source import Source
from megacli.errors import UserError
from megacli.recipe.base import RecipeError
from megacli.recipe.model import ModelSection
from tests import _convert_models as cm

TOL = 1e-4
NAMES = list(cm.FAMILY_MODELS)
NEW = 8
TP2PP2 = ("parallel.tensor=2", "parallel.pipeline=2", "parallel.first_stage_layers=1", "launch.nproc=4")


def _prompts():
    import torch

    return [torch.randint(3, cm.VOCAB, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in (5, 6)]


def _hf_greedy(model):
    import torch

    ids = torch.tensor(_prompts())
    with torch.no_grad():  # an explicit mask: token 0 in a prompt is not padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                             eos_token_id=None, pad_token_id=0)
    return out[:, ids.size(1):].tolist()


def _greedy(ckpt: Path, runtime, sets=()):
    from megacli.data.tokenizers import load_tokenizer
    from megacli.inference.generator import Generator
    from megacli.inference.runner import Model
    from megacli.recipe import base
    from megacli.recipe.generate import GenerateRecipe

    raw = base.read_yaml(ckpt / "iter_0000000" / "recipe.yaml")
    raw["launch"].update(nproc=1, device="cpu")
    raw["parallel"].update(tensor=1, pipeline=1, first_stage_layers=None, sequence_parallel=False)
    raw["train"]["global_batch_size"] = raw["train"]["micro_batch_size"]
    for item in sets:
        key, value = item.split("=")
        section, field = key.split(".")
        raw[section][field] = int(value)
    recipe = base.validate(GenerateRecipe, {**raw, "generate": {"checkpoint": str(ckpt), "max_new_tokens": NEW,
                                                                 "stop_at_eod": False}}, "test")
    tok = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path)
    gen = Generator(Model(recipe, runtime, vocab_size=recipe.model.vocab_size), tok, recipe.generate)
    return [list(t) for t in gen._sample(_prompts(), None).tokens]  # token prompts: no text round trip


def _hf_norm_grads(model, toks) -> dict:
    """Gradients of OLMo 2's norm gains under the summed next-token loss."""
    import torch.nn.functional as F

    model.zero_grad()
    logits = model(toks).logits
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), toks[:, 1:].reshape(-1), reduction="sum").backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if "norm" in n and "layers." in n}


def _prepare(rank, world, root: str):
    import torch

    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    root, toks, out = Path(root), cm.tokens(), {}
    for name in NAMES:
        d = root / name
        model = cm.build_hf(name, d / "hf", with_tokenizer=True)
        torch.save(cm.hf_logits(model, toks), d / "hf_logits.pt")
        if name == "olmo2":
            torch.save(_hf_norm_grads(model, toks), d / "hf_grads.pt")
        said: list[str] = []
        out[name] = {**cm.round_trip(d, parallel=ParallelSection(tensor=2, pipeline=2), say=said.append),
                     "said": said, "hf_greedy": _hf_greedy(model)}
    runtime = distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu"), seed=0)
    for name in NAMES:
        out[name]["tp1_logits"] = cm.max_diff(cm.megacli_logits(root / name / "mc", toks), torch.load(root / name / "hf_logits.pt"))
        out[name]["greedy"] = _greedy(root / name / "mc", runtime)
    distributed.teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("families")
    return root, spawn(_prepare, 1, str(root), timeout=1800)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bitwise_with_the_same_config(converted, name):
    r = converted[1][name]
    assert r["same_keys"] and r["bitwise"]
    src, back = r["config"]
    assert src == back and src["architectures"] == [cm.ARCHITECTURES[cm.FAMILY_MODELS[name][0]]]
    assert any("layers per pipeline stage: [1, 2]" in line for line in r["said"]), r["said"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_logits_and_greedy_generation_equal_hugging_face_at_tp1(converted, name):
    r = converted[1][name]
    assert r["tp1_logits"] < TOL
    assert r["greedy"] == r["hf_greedy"]


def test_recipe_sections_of_the_configs():
    """The features each family brings, as recipe fields."""
    from megacli.convert import families

    sections = {}
    for name, (cls_name, kwargs) in cm.FAMILY_MODELS.items():
        import transformers

        config = getattr(transformers, cls_name)(**kwargs).to_dict()
        config["architectures"] = [cm.ARCHITECTURES[cls_name]]
        family, _ = families.for_hf_config(config)
        sections[name] = ModelSection(**family.model_section(config))
        assert families.for_model(sections[name])[1] == config["architectures"][0], name
    qwen, olmo, phi = sections["qwen3_moe"], sections["olmo2"], sections["phi4_mini"]
    assert qwen.qk_layernorm and qwen.qk_norm_scope == "head" and qwen.head_dim == 16 and qwen.moe_layers() == [1, 0, 1]
    assert not qwen.moe.router_pre_softmax and qwen.moe.shared_expert_ffn_hidden_size is None
    assert olmo.norm_placement == "output" and olmo.qk_norm_scope == "projection" and olmo.untie_embeddings
    assert phi.rotary_percent == 0.75 and not phi.untie_embeddings and phi.head_dim == 16


def test_longrope_and_bad_norm_fields_are_refused():
    from megacli.convert.families import phi3

    config = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 256, "partial_rotary_factor": 0.75,
              "original_max_position_embeddings": 64,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}}
    with pytest.raises(UserError, match="'longrope' .rope_scaling / rope_parameters. does not convert: longrope's per-dimension short and long factors.*no equivalent"):
        phi3.model_section(config)
    assert phi3.model_section({**config, "rope_scaling": None})["rotary_percent"] == 0.75
    windowed = phi3.model_section({**config, "rope_scaling": None, "sliding_window": 127})  # Phi-3-mini-4k: 2047
    assert windowed["sliding_window"] == 127 and windowed.get("sliding_window_layers") is None
    with pytest.raises(RecipeError, match="model.qk_norm_scope.*needs model.arch = gpt and model.qk_layernorm = true"):
        ModelSection(qk_norm_scope="projection", normalization="rmsnorm")
    with pytest.raises(RecipeError, match="model.qk_norm_scope.*RMSNorm"):
        ModelSection(qk_norm_scope="projection", qk_layernorm=True)
    with pytest.raises(RecipeError, match="model.norm_placement.*gpt layer option"):
        ModelSection(arch="bert", norm_placement="output")
    from types import SimpleNamespace

    from megacli.checkpoint.megatron_lm.args_namespace import unsupported

    for field, model in (("norm_placement", ModelSection(norm_placement="output")),
                         ("qk_norm_scope", ModelSection(qk_norm_scope="projection", qk_layernorm=True, normalization="rmsnorm"))):
        assert [p for p in unsupported(SimpleNamespace(model=model, lora=None)) if p.startswith(f"model.{field} ")]
    assert unsupported(SimpleNamespace(model=ModelSection(norm_placement="pre"), lora=None)) == []


# ---------------------------------------------------------------- TP=2 × PP=2 (and EP=2), one run


def _megacli_norm_grads(ckpt_dir: Path, toks) -> dict:
    """Gradients of the norm gains of this rank's layers under the summed next-token loss, through
    Megatron's training schedule (forward and backward across stages), by global layer number."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megacli.engine import checkpoint
    from megacli.engine.models import build_model
    from megacli.engine.models.config import transformer_config
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    ckpt = checkpoint.find_checkpoint(ckpt_dir)
    recipe = load(TrainingRecipe, ckpt / "recipe.yaml", [*TP2PP2, "parallel.sequence_parallel=false", "train.global_batch_size=8"])
    config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="fp32", on_cuda=False)
    chunks = build_model(recipe=recipe, config=config, vocab_size=recipe.model.vocab_size)
    checkpoint.load(source=Source(ckpt), chunks=chunks, optimizer=None, scheduler=None, load_optimizer=False)
    net = chunks[0]
    b, s = toks.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)

    def forward_step(data_iterator, model):
        out = model(next(data_iterator), positions, None)

        def loss(output):
            logits = gather_from_tensor_model_parallel_region(output)[..., : recipe.model.vocab_size]
            total = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), toks[:, 1:].reshape(-1), reduction="sum")
            return total, torch.tensor(1), {}

        return out, loss

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([toks]), model=net, num_microbatches=1,
                                seq_length=s, micro_batch_size=b, forward_only=False)
    grads = {}
    for mod_name, mod in net.named_modules():
        if hasattr(mod, "layer_number") and type(mod).__name__ == "TransformerLayer":
            for pname, p in mod.named_parameters():
                if "norm" in pname and p.grad is not None:
                    grads[(mod.layer_number - 1, pname)] = p.grad.clone()
    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "grads": grads}


def _parallel(rank, world, root: str):
    import torch
    from megatron.core import parallel_state as ps

    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    root, toks, out = Path(root), cm.tokens(), {}
    runtime = distributed.setup(parallel=ParallelSection(tensor=2, pipeline=2, first_stage_layers=1),
                                launch=LaunchSection(nproc=4, device="cpu"), seed=0)
    for name in NAMES:
        sp = ("parallel.sequence_parallel=true",) if name == "qwen3_moe" else ()
        got = cm.megacli_logits(root / name / "mc", toks, ("parallel.first_stage_layers=1", *sp))
        out[(name, "logits")] = None if got is None else cm.max_diff(got, torch.load(root / name / "hf_logits.pt"))
        # decoding runs without sequence parallelism (a one-token step cannot be split), MoE too (Megatron
        # needs it only to train MoE layers under TP)
        out[(name, "greedy")] = _greedy(root / name / "mc", runtime, TP2PP2)
    out["olmo2_grads"] = _megacli_norm_grads(root / "olmo2" / "mc", toks)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, expert_model_parallel_size=2)
    got = cm.megacli_logits(root / "qwen3_moe" / "mc", toks,
                            ("parallel.first_stage_layers=1", "parallel.expert=2", "launch.nproc=4"))
    out[("qwen3_moe", "ep2")] = None if got is None else cm.max_diff(got, torch.load(root / "qwen3_moe" / "hf_logits.pt"))
    distributed.teardown()
    return out


@pytest.fixture(scope="module")
def parallel_runs(converted):
    from tests._dist import spawn

    return spawn(_parallel, 4, str(converted[0]), timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_logits_and_greedy_generation_equal_hugging_face_at_tp2_pp2(converted, parallel_runs, name):
    diffs = [r[(name, "logits")] for r in parallel_runs if r[(name, "logits")] is not None]
    assert len(diffs) == 1 and diffs[0] < TOL, diffs  # the last stage's first TP rank
    for r in parallel_runs:  # every rank makes the same choices
        assert r[(name, "greedy")] == converted[1][name]["hf_greedy"]


@pytest.mark.slow
def test_qwen3_moe_logits_equal_hugging_face_at_ep2(parallel_runs):
    diffs = [r[("qwen3_moe", "ep2")] for r in parallel_runs if r[("qwen3_moe", "ep2")] is not None]
    assert len(diffs) == 2 and max(diffs) < TOL, diffs  # the last stage's two data/expert-parallel ranks


@pytest.mark.slow
def test_olmo2_norm_gradients_equal_hugging_face_at_tp2_pp2(converted, parallel_runs):
    """q_norm / k_norm gains are split over TP (each rank's slice of HF's gradient), the output
    norms' replicated (the whole of it); together they show the all-reduced sum of squares
    backpropagates as the whole-projection norm does."""
    import torch

    ref = torch.load(converted[0] / "olmo2" / "hf_grads.pt")
    names = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
             "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
             "self_attn_bda.norm.weight": "post_attention_layernorm.weight",
             "mlp_bda.norm.weight": "post_feedforward_layernorm.weight"}
    seen = set()
    for r in parallel_runs:
        rank, grads = r["olmo2_grads"]["tp_rank"], r["olmo2_grads"]["grads"]
        for (layer, pname), grad in grads.items():
            want = ref[f"model.layers.{layer}.{names[pname]}"]
            if "q_layernorm" in pname or "k_layernorm" in pname:
                want = want.chunk(2)[rank]
            assert grad.shape == want.shape and cm.max_diff(grad, want) < TOL * max(1.0, float(want.abs().max())), (layer, pname)
            seen.add((layer, pname, rank))
    assert len(seen) == 3 * 4 * 2  # every layer's four norms on both TP ranks


@pytest.mark.slow
def test_olmo2_pretrains_at_tp2_and_exports(converted, tmp_path):
    """The converted OLMo 2's recipe runs `megacli pretrain` at TP=2 (two processes: the TP-split
    q/k norm gains go through the optimizer and the checkpoint), and the trained checkpoint exports
    to an HF model with the source's config whose q/k norm gains moved."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    root, _ = converted
    ck = root / "olmo2" / "mc"
    sets = ["train.iters=2", "train.eval_interval=null", "train.log_interval=1", "model.seq_length=16",
            "train.global_batch_size=2", "optim.lr=1e-2", "optim.warmup_iters=0", f"run.dir={tmp_path / 'run'}",
            f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.save_interval=2", "parallel.pipeline=1",
            "parallel.first_stage_layers=null", "launch.nproc=2"]
    run = [sys.executable, "-m", "megacli"]
    out = subprocess.run([*run, "pretrain", str(ck / "iter_0000000" / "recipe.yaml"), *[x for s in sets for x in ("--set", s)]],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2] and all(0 < x < 20 for x in losses)
    out = subprocess.run([*run, "convert", str(tmp_path / "ck"), str(tmp_path / "hf")], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == converted[1]["olmo2"]["config"][0]
    before, after = load_file(root / "olmo2" / "hf" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for key in ("model.layers.0.self_attn.q_norm.weight", "model.layers.2.self_attn.k_norm.weight"):
        assert before[key].shape == after[key].shape and not before[key].equal(after[key]), key


def test_configs_written_from_the_recipe_alone():
    """A model trained from scratch (no carried config.json) exports a config Hugging Face reads
    back as the same model: the families' features survive in transformers' own config classes."""
    import transformers

    from megacli.convert import families

    for name, (cls_name, kwargs) in cm.FAMILY_MODELS.items():
        source = getattr(transformers, cls_name)(**kwargs).to_dict()
        source["architectures"] = [cm.ARCHITECTURES[cls_name]]
        family, _ = families.for_hf_config(source)
        model = ModelSection(**family.model_section(source))
        family_out, architecture = families.for_model(model)
        written = family_out.hf_config(model, architecture=architecture, vocab_size=cm.VOCAB, base=None)
        back = transformers.AutoConfig.for_model(written.pop("model_type"), **written)
        assert ModelSection(**family.model_section({**back.to_dict(), "architectures": [architecture]})) == model, name
