"""`megacli convert` for BERT: tiny random models of the four BERT architectures, built from a config
dict: BertForPreTraining and BertForMaskedLM (post-LN, the original BERT) and their Megatron-LM
ports MegatronBertForPreTraining and MegatronBertForMaskedLM (pre-LN). Checked for each: HF ->
megacli -> HF is bitwise with the same config; the converted model's masked-LM (and next-sentence)
logits on a padded batch with both token types equal Hugging Face's at TP=1 and at TP=2 × PP=2.
Also: a pretraining checkpoint labelled BertForMaskedLM with bert-base-uncased's gamma/beta names
imports, and a BERT without token types is refused on export with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megacli.checkpoint.source import Source

from tests import _convert_models as cm

TOL = 1e-4
CONFIG = dict(vocab_size=cm.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _batch():
    toks = cm.tokens()
    types = torch.zeros_like(toks)
    types[:, 8:] = 1
    attend = torch.ones_like(toks)
    attend[1, 12:] = 0  # the second sample is padded
    return toks, types, attend


ARCHITECTURES = ("BertForPreTraining", "BertForMaskedLM", "MegatronBertForPreTraining", "MegatronBertForMaskedLM")
# One model with the tanh GELU: the masked-LM head's transform must use it too (Megatron's hard-codes GELU).
CONFIG_CHANGES = {"BertForMaskedLM": dict(hidden_act="gelu_new")}


def _hf_class(architecture: str):
    import transformers

    config = transformers.MegatronBertConfig if architecture.startswith("Megatron") else transformers.BertConfig
    return config, getattr(transformers, architecture)


def _build_hf(path: Path, architecture: str):
    from megacli.convert import hf_io

    config_class, model_class = _hf_class(architecture)
    torch.manual_seed(0)
    model = model_class(config_class(**{**CONFIG, **CONFIG_CHANGES.get(architecture, {})}, architectures=[architecture]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln.weight") or "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    model.eval().save_pretrained(path)
    # A WordPiece vocabulary with BERT's special tokens (what masking needs), one entry per row.
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz"]
    (path / "vocab.txt").write_text("\n".join(words + [f"w{i}" for i in range(cm.VOCAB - len(words))]) + "\n")
    hf_io.save_wordpiece_tokenizer(path / "vocab.txt", path, lower_case=True)
    return model


def _hf_logits(model):
    toks, types, attend = _batch()
    with torch.no_grad():
        out = model(input_ids=toks, token_type_ids=types, attention_mask=attend)
    if hasattr(out, "seq_relationship_logits"):
        return out.prediction_logits.float(), out.seq_relationship_logits.float()
    return (out.logits.float(),)


def _megacli_logits(ckpt_dir: Path):
    """(masked-LM logits, binary logits) of a BERT checkpoint through the engine under the current
    parallel state (masked-LM logits alone without the binary head); None except on the last
    pipeline stage's first TP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megacli.engine import checkpoint
    from megacli.engine.models import build_model
    from megacli.engine.models.config import transformer_config
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ckpt = checkpoint.find_checkpoint(ckpt_dir)
    recipe = load(TrainingRecipe, ckpt / "recipe.yaml", [f"parallel.tensor={tp}", f"parallel.pipeline={pp}",
                                                         "parallel.sequence_parallel=false", f"launch.nproc={tp * pp}"])
    config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="fp32", on_cuda=False)
    chunks = build_model(recipe=recipe, config=config, vocab_size=recipe.model.vocab_size)
    checkpoint.load(source=Source(ckpt), chunks=chunks, optimizer=None, scheduler=None, load_optimizer=False)
    chunks[0].eval()
    toks, types, attend = _batch()

    def forward_step(data_iterator, model):
        output = model(*next(data_iterator))

        def collect(output):
            logits, binary = output
            full = gather_from_tensor_model_parallel_region(logits)
            return logits.sum() * 0, torch.tensor(1), {"logits": full.detach(), "binary": binary}

        return output, collect

    with torch.no_grad():
        reports = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([(toks, attend, types)]),
                                              model=chunks[0], num_microbatches=1, seq_length=toks.shape[1],
                                              micro_batch_size=toks.shape[0], forward_only=True)
    if not ps.is_pipeline_last_stage() or ps.get_tensor_model_parallel_rank() != 0:
        return None
    logits, binary = reports[0]["logits"][..., : recipe.model.vocab_size].float(), reports[0]["binary"]
    return (logits,) if binary is None else (logits, binary.float())


def _convert_both_ways(rank, world, root: str) -> dict:
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    out = {}
    for architecture in ARCHITECTURES:
        d = Path(root) / architecture
        ref = _hf_logits(_build_hf(d / "hf", architecture))
        torch.save(ref, d / "hf_logits.pt")
        out[architecture] = cm.round_trip(d, parallel=ParallelSection(tensor=2, pipeline=2))
        distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu"), seed=0)
        ours = _megacli_logits(d / "mc")
        distributed.teardown()
        out[architecture]["tp1"] = [cm.max_diff(x, y) for x, y in zip(ours, ref, strict=True)]
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("convert_bert")
    return root, spawn(_convert_both_ways, 1, str(root), timeout=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_round_trip_is_bitwise_and_logits_match_at_tp1(converted, architecture):
    _, results = converted
    out = results[architecture]
    assert out["same_keys"] and out["bitwise"]
    src, back = out["config"]
    assert src == back
    assert len(out["tp1"]) == (2 if architecture.endswith("PreTraining") else 1)
    assert max(out["tp1"]) < TOL, out["tp1"]


def _logits_tp2_pp2(rank, world, root: str):
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    distributed.setup(parallel=ParallelSection(tensor=2, pipeline=2), launch=LaunchSection(device="cpu", nproc=4), seed=0)
    out = {a: _megacli_logits(Path(root) / a / "mc") for a in ARCHITECTURES}
    distributed.teardown()
    return out if any(v is not None for v in out.values()) else None


@pytest.mark.slow
def test_logits_match_hf_at_tp2_pp2(converted):
    from tests._dist import spawn

    root, _ = converted
    results = [r for r in spawn(_logits_tp2_pp2, 4, str(root)) if r is not None]
    assert len(results) == 1, "exactly one rank (last stage, TP rank 0) reports logits"
    for architecture in ARCHITECTURES:
        ref = torch.load(root / architecture / "hf_logits.pt")
        diffs = [cm.max_diff(x, y) for x, y in zip(results[0][architecture], ref, strict=True)]
        assert max(diffs) < TOL, (architecture, diffs)


def test_a_pretraining_checkpoint_with_gamma_beta_names_imports_as_masked_lm(tmp_path):
    """bert-base-uncased's shape: config says BertForMaskedLM, the weights are a pretraining
    checkpoint's (pooler and NSP head included) with LayerNorm gamma/beta names."""
    from safetensors.torch import load_file, save_file

    from megacli.convert import convert
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    _build_hf(tmp_path / "hf", "BertForPreTraining")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in weights.items()}
    assert any(k.endswith("gamma") for k in renamed)
    save_file(renamed, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    convert(Source(tmp_path / "hf"), tmp_path / "mc", say=lambda *_: None)
    recipe = load(TrainingRecipe, next((tmp_path / "mc").glob("iter_*")) / "recipe.yaml")
    assert (recipe.model.norm_position, recipe.model.bert_binary_head, recipe.model.token_types) == ("post", False, 2)
    convert(Source(tmp_path / "mc"), tmp_path / "hf2", say=lambda *_: None)
    back = load_file(tmp_path / "hf2" / "model.safetensors")
    assert not any(k.startswith(("bert.pooler", "cls.seq_relationship")) for k in back)
    assert all(torch.equal(back[k], weights[k]) for k in back)
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]


def test_a_bert_without_token_types_is_refused_on_export():
    from megacli.convert import families
    from megacli.errors import UserError
    from megacli.recipe.model import ModelSection

    model = ModelSection(arch="bert", bert_binary_head=False)
    with pytest.raises(UserError) as err:
        families.for_model(model)
    assert "no token-type embeddings" in str(err.value) and "bert_token_types: 2" in str(err.value)
    assert families.for_model(model.model_copy(update={"bert_token_types": 2}))[1] == "MegatronBertForMaskedLM"


# ---------------------------------------------------------------- Megatron-LM legacy BERT checkpoints

def _legacy_bert_state(local: dict, style: str) -> dict:
    """A stage's canonical tensors (local layer numbers) as pretrain_bert.py saves them: "mcore"
    (Megatron-Core BertModel, local-spec norm names) or "legacy" (megatron/legacy/model/bert_model.py:
    nested language_model dicts, lm_head.bias / lm_head.norm)."""
    if style == "mcore":
        return {k.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
                 .replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."): t for k, t in local.items()}
    return cm._legacy_model_state(local, stack="encoder")


def _write_legacy_bert(hf_dir: Path, out: Path, *, tp: int, pp: int, style: str) -> None:
    """A Megatron-LM legacy BERT checkpoint (pretrain_bert.py, --ckpt-format torch) of an HF
    MegatronBertForPreTraining at TP × PP: iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt."""
    import argparse

    vocab = len((hf_dir / "vocab.txt").read_text().splitlines()) + 2  # Megatron's WordPiece adds [BOS] [EOS]
    padded = -(-vocab // (128 * tp)) * 128 * tp
    tensors, m = cm._canonical_from_hf(hf_dir, padded_rows=padded)
    args = argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_size, seq_length=m.seq_length, max_position_embeddings=m.max_positions,
        position_embedding_type="learned_absolute", normalization="LayerNorm", norm_epsilon=m.norm_epsilon,
        add_bias_linear=True, bert_binary_head=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        make_vocab_size_divisible_by=128, padded_vocab_size=padded, tokenizer_type="BertWordPieceLowerCase",
        vocab_file=str(hf_dir / "vocab.txt"), hidden_dropout=0.1, attention_dropout=0.1, iteration=10, ckpt_format="torch")
    per_stage = m.num_layers // pp
    column = ("word_embeddings.weight", "output_layer.bias", "linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight",
              "linear_fc1.bias")
    for p in range(pp):
        local = {}
        for key, t in tensors.items():
            if key.startswith("encoder.layers."):
                num, _, rest = key[len("encoder.layers."):].partition(".")
                if p * per_stage <= int(num) < (p + 1) * per_stage:
                    local[f"encoder.layers.{int(num) - p * per_stage}.{rest}"] = t
            elif key.startswith("embedding."):
                if p == 0:
                    local[key] = t
            elif p == pp - 1:
                local[key] = t
        if p == pp - 1 and pp > 1:  # the last stage's copy of the tied word embedding
            name = "output_layer.weight" if style == "mcore" else "word_embeddings_for_head.weight"
            local[name] = tensors["embedding.word_embeddings.weight"]
        for r in range(tp):
            def shard(key, t):
                if key.endswith(column) or key == "word_embeddings_for_head.weight":
                    return t.chunk(tp, dim=0)[r].clone()
                if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
                    return t.chunk(tp, dim=1)[r].clone()
                return t.clone()

            state = _legacy_bert_state({k: shard(k, t) for k, t in local.items()}, style)
            d = out / "iter_0000010" / (f"mp_rank_{r:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            d.mkdir(parents=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10, "model": state,
                        "optimizer": {}, "opt_param_scheduler": {}}, d / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text("10")


@pytest.mark.parametrize("style, tp, pp", [("legacy", 2, 2), ("mcore", 2, 1)])
def test_megatron_lm_legacy_bert_checkpoint_converts_with_the_same_logits(tmp_path, style, tp, pp):
    """legacy -> HF: MegatronBertForPreTraining with the source model's logits (on the vocabulary
    the HF model has; Megatron's tokenizer adds [BOS]/[EOS]) and BERT tokenizer files; legacy ->
    megacli -> HF gives the same tensors."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, MegatronBertForPreTraining

    from megacli.convert import convert
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    source = _build_hf(tmp_path / "hf", "MegatronBertForPreTraining")
    _write_legacy_bert(tmp_path / "hf", tmp_path / "legacy", tp=tp, pp=pp, style=style)
    said = []
    convert(Source(tmp_path / "legacy"), tmp_path / "out", to="hf", say=said.append)
    assert any("legacy BERT checkpoint" in s for s in said), said
    exported = MegatronBertForPreTraining.from_pretrained(tmp_path / "out").eval()
    assert exported.config.vocab_size == cm.VOCAB + 2
    ours, ref = _hf_logits(exported), _hf_logits(source)
    assert cm.max_diff(ours[0][..., : cm.VOCAB], ref[0]) < TOL and cm.max_diff(ours[1], ref[1]) < TOL
    words = (tmp_path / "hf" / "vocab.txt").read_text().splitlines()
    text = "a B c w7"  # BertWordPieceLowerCase: lower-cased, each word one vocabulary entry
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text, add_special_tokens=False)["input_ids"] == \
        [words.index(w) for w in text.lower().split()]

    convert(Source(tmp_path / "legacy"), tmp_path / "mc", say=lambda *_: None)
    recipe = load(TrainingRecipe, next((tmp_path / "mc").glob("iter_*")) / "recipe.yaml")
    assert (recipe.model.arch, recipe.model.norm_position, recipe.model.bert_binary_head) == ("bert", "pre", True)
    assert (recipe.tokenizer.type, Path(recipe.tokenizer.path).name) == ("wordpiece", "vocab.txt")
    convert(Source(tmp_path / "mc"), tmp_path / "hf2", say=lambda *_: None)
    a, b = load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_legacy_t5_is_refused_and_reshard_refuses_bert(tmp_path):
    import argparse

    from megacli.convert import convert
    from megacli.errors import UserError
    from megacli.checkpoint.megatron_lm.legacy_staging import open_source

    d = tmp_path / "t5" / "iter_0000001" / "mp_rank_00"
    d.mkdir(parents=True)
    args = argparse.Namespace(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1)
    model = {"language_model": {"encoder": {"layers.0.mlp.dense_h_to_4h.weight": torch.zeros(2, 2)},
                                "decoder": {"layers.0.inter_attention.query.weight": torch.zeros(2, 2)}}}
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model}, d / "model_optim_rng.pt")
    (tmp_path / "t5" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(UserError, match="encoder-decoder"):
        convert(Source(tmp_path / "t5"), tmp_path / "out", say=lambda *_: None)
    assert not (tmp_path / "out").exists()

    _build_hf(tmp_path / "hf", "MegatronBertForPreTraining")
    _write_legacy_bert(tmp_path / "hf", tmp_path / "bert", tp=1, pp=1, style="legacy")
    with pytest.raises(UserError, match="megacli convert"):
        open_source(Source(tmp_path / "bert"))


@pytest.mark.slow
def test_a_bert_without_tokenizer_files_converts_and_only_training_needs_one(tmp_path):
    _build_hf(tmp_path / "hf", "BertForMaskedLM")
    cm.check_converts_without_tokenizer(tmp_path / "hf", tmp_path / "mc", "bert")
