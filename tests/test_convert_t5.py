"""`megacli convert` for T5: tiny random T5ForConditionalGeneration models (gated-GELU with the LM
head tied to the embedding, ReLU with a separate LM head, ReLU tied with the original T5's output
scaling; relative position biases) built from config dicts. Checked: HF -> megacli -> HF is bitwise with the same config;
the converted model's logits (padded encoder batch, teacher-forced decoder) equal Hugging Face's at
TP=1 and TP=2 (T5 has no pipeline parallelism in Megatron-Core 0.16.1), also for a T5 that scales
its decoder output before the tied head (t5-small style)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megacli.checkpoint.source import Source

from tests import _convert_models as cm

TOL = 1e-4
COMMON = dict(vocab_size=cm.VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
              dropout_rate=0.0, decoder_start_token_id=0)
# name -> (config, tied LM head, decoder output scaled by d_model**-0.5 as in the original T5)
MODELS = {"t5_gated_tied": (dict(feed_forward_proj="gated-gelu"), True, False),
          "t5_relu_untied": (dict(feed_forward_proj="relu"), False, False),
          "t5_relu_scaled": (dict(feed_forward_proj="relu"), True, True)}


def _batch():
    enc = cm.tokens(1)
    dec = cm.tokens(2)[:, :10]
    attend = torch.ones_like(enc)
    attend[1, 11:] = 0  # the second encoder sample is padded
    return enc, dec, attend


def _build_hf(name: str, path: Path):
    from megacli.convert import hf_io
    from transformers import T5Config, T5ForConditionalGeneration

    kwargs, tied, scaled = MODELS[name]
    # transformers 5 reads tie_word_embeddings at construction as "scale the decoder output", and ties
    # the head unless told so afterwards.
    config = T5Config(**COMMON, **kwargs, tie_word_embeddings=scaled, architectures=["T5ForConditionalGeneration"])
    config.tie_word_embeddings = tied
    torch.manual_seed(1)
    model = T5ForConditionalGeneration(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "layer_norm" in pname else p.normal_(0, 0.1)
        for stack in (model.encoder, model.decoder):  # as in T5 checkpoints: both stacks read the shared table
            stack.embed_tokens.weight.copy_(model.shared.weight)
    model.eval().save_pretrained(path)
    # A WordPiece vocabulary with the special tokens the T5 recipe needs (sentinels are appended).
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (path / "vocab.txt").write_text("\n".join(words + [f"w{i}" for i in range(cm.VOCAB - 100 - len(words))]) + "\n")
    hf_io.save_wordpiece_tokenizer(path / "vocab.txt", path, lower_case=True)
    enc, dec, attend = _batch()
    with torch.no_grad():
        return model(input_ids=enc, attention_mask=attend, decoder_input_ids=dec).logits.float()


def _megacli_logits(ckpt_dir: Path):
    """Logits of a T5 checkpoint through the engine under the current TP; None on TP rank > 0."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megacli.engine import checkpoint
    from megacli.engine.models import build_model
    from megacli.engine.models.config import transformer_config
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    tp = ps.get_tensor_model_parallel_world_size()
    ckpt = checkpoint.find_checkpoint(ckpt_dir)
    recipe = load(TrainingRecipe, ckpt / "recipe.yaml", [f"parallel.tensor={tp}", "parallel.sequence_parallel=false",
                                                         f"launch.nproc={tp}"])
    config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="fp32", on_cuda=False)
    model = build_model(recipe=recipe, config=config, vocab_size=recipe.model.vocab_size)[0]
    checkpoint.load(source=Source(ckpt), chunks=[model], optimizer=None, scheduler=None, load_optimizer=False)
    model.eval()
    enc, dec, attend = _batch()
    pad = (attend == 0)[:, None, None, :]
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(enc, dec, pad, None, pad))
    return logits[..., : recipe.model.vocab_size].float() if ps.get_tensor_model_parallel_rank() == 0 else None


def _convert_both_ways(rank, world, root: str) -> dict:
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    root, out = Path(root), {}
    for name in MODELS:
        d = root / name
        torch.save(_build_hf(name, d / "hf"), d / "hf_logits.pt")
        out[name] = cm.round_trip(d, parallel=ParallelSection(tensor=2))
    distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu"), seed=0)
    for name in MODELS:
        out[name]["tp1"] = cm.max_diff(_megacli_logits(root / name / "mc"), torch.load(root / name / "hf_logits.pt"))
    distributed.teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("convert_t5")
    return root, spawn(_convert_both_ways, 1, str(root), timeout=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_is_bitwise_and_logits_match_at_tp1(converted, name):
    _, out = converted
    r = out[name]
    assert r["same_keys"] and r["bitwise"]
    src, back = r["config"]
    assert src == back
    assert r["tp1"] < TOL, r["tp1"]


def _logits_tp2(rank, world, root: str):
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    distributed.setup(parallel=ParallelSection(tensor=2), launch=LaunchSection(device="cpu", nproc=2), seed=0)
    out = {name: _megacli_logits(Path(root) / name / "mc") for name in MODELS}
    distributed.teardown()
    return out


@pytest.mark.slow
def test_logits_match_hf_at_tp2(converted):
    from tests._dist import spawn

    root, _ = converted
    first, second = spawn(_logits_tp2, 2, str(root))
    for name in MODELS:
        assert second[name] is None
        assert cm.max_diff(first[name], torch.load(root / name / "hf_logits.pt")) < TOL, name


PROMPTS = ["w5 w17 w3 w40 w2 w9 w11", "w8 w1"]  # two lengths: the second encoder input is padded
NEW = 8
GENERATE_MODEL = "t5_gated_tied"


@pytest.mark.slow
@pytest.mark.parametrize("tensor", [1, 2])
def test_generate_greedy_equals_hf_generate(converted, tensor, tmp_path):
    """`megacli generate` on a converted T5 (flan-T5 style: gated GELU, tied head) gives Hugging
    Face's greedy tokens for a padded batch: the decoder starts from the carried config's
    decoder_start_token_id, the encoder masks the padding."""
    import json

    from transformers import AutoTokenizer, T5ForConditionalGeneration

    from tests.conftest import megacli, megacli_here

    root, _ = converted
    hf_dir = root / GENERATE_MODEL / "hf"
    tok = AutoTokenizer.from_pretrained(hf_dir)
    enc = tok(PROMPTS, add_special_tokens=False, padding=True, return_tensors="pt")
    model = T5ForConditionalGeneration.from_pretrained(hf_dir).eval()
    model.generation_config.eos_token_id = None  # run all NEW steps, as stop_at_eod=false does below
    with torch.no_grad():
        ref = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=NEW,
                             do_sample=False)
    assert (ref[:, 0] == 0).all()  # HF starts the decoder from decoder_start_token_id (0)
    want = [row[1:].tolist() for row in ref]
    assert want[0] != want[1] and len(set(want[0])) > 1, want  # continuations that depend on the input

    out = tmp_path / "out.jsonl"
    args = ["--checkpoint", root / GENERATE_MODEL / "mc", *[x for p in PROMPTS for x in ("--prompt", p)], "-n", NEW,
            "--tensor", tensor, "--output", out, "--set", "generate.stop_at_eod=false", "--set", f"run.dir={tmp_path / 'run'}"]
    res = megacli_here("generate", *args) if tensor == 1 else megacli("generate", *args)  # TP 2: the launcher's workers
    assert res.returncode == 0, res.stderr[-3000:]
    got = [json.loads(line)["tokens"] for line in out.read_text().splitlines()]
    assert got == want


@pytest.mark.slow
def test_a_t5_without_tokenizer_files_converts_and_only_training_needs_one(tmp_path):
    _build_hf("t5_gated_tied", tmp_path / "hf")
    cm.check_converts_without_tokenizer(tmp_path / "hf", tmp_path / "mc", "t5")


def test_the_hf_export_keeps_the_sentinels_training_appended(tmp_path):
    """A T5 trained with a tokenizer that lacks T5's sentinels (model.vocab_size unset): training
    appends masking.sentinel_tokens ids, and the HF export keeps their rows (megacli.plan.model_vocab_size)."""
    from types import SimpleNamespace

    from megacli.convert.run import _vocab_of
    from megacli.data.tokenizers import load_tokenizer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(40)]) + "\n")
    recipe = SimpleNamespace(model=SimpleNamespace(vocab_size=None, arch="t5"), masking=SimpleNamespace(sentinel_tokens=16),
                             tokenizer=SimpleNamespace(type="wordpiece", path=str(vocab)))
    size, tokenizer = _vocab_of(tmp_path, recipe)
    assert size == load_tokenizer(type="wordpiece", path=str(vocab)).vocab_size + 16 == tokenizer.vocab_size + 16
    recipe.model.arch = "gpt"
    assert _vocab_of(tmp_path, recipe)[0] == tokenizer.vocab_size
