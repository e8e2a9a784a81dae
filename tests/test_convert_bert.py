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


def _hf_class(architecture: str):
    import transformers

    config = transformers.MegatronBertConfig if architecture.startswith("Megatron") else transformers.BertConfig
    return config, getattr(transformers, architecture)


def _build_hf(path: Path, architecture: str):
    from transformers import BertTokenizerFast

    config_class, model_class = _hf_class(architecture)
    torch.manual_seed(0)
    model = model_class(config_class(**CONFIG, architectures=[architecture]))
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
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
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
    from megacli.engine.models import build_model, transformer_config
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ckpt = checkpoint.find_checkpoint(ckpt_dir)
    recipe = load(TrainingRecipe, ckpt / "recipe.yaml", [f"parallel.tensor={tp}", f"parallel.pipeline={pp}",
                                                         "parallel.sequence_parallel=false", f"launch.nproc={tp * pp}"])
    config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="fp32", on_cuda=False)
    chunks = build_model(recipe=recipe, config=config, vocab_size=recipe.model.vocab_size)
    checkpoint.load(ckpt=ckpt, chunks=chunks, optimizer=None, scheduler=None, load_optimizer=False)
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
    convert(tmp_path / "hf", tmp_path / "mc", say=lambda *_: None)
    recipe = load(TrainingRecipe, next((tmp_path / "mc").glob("iter_*")) / "recipe.yaml")
    assert (recipe.model.norm_position, recipe.model.bert_binary_head, recipe.model.token_types) == ("post", False, 2)
    convert(tmp_path / "mc", tmp_path / "hf2", say=lambda *_: None)
    back = load_file(tmp_path / "hf2" / "model.safetensors")
    assert not any(k.startswith(("bert.pooler", "cls.seq_relationship")) for k in back)
    assert all(torch.equal(back[k], weights[k]) for k in back)
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]


def test_a_bert_without_token_types_is_refused_on_export():
    from megacli.convert import families
    from megacli.errors import UserError
    from megacli.recipe.sections import ModelSection

    model = ModelSection(arch="bert", bert_binary_head=False)
    with pytest.raises(UserError) as err:
        families.for_model(model)
    assert "no token-type embeddings" in str(err.value) and "bert_token_types: 2" in str(err.value)
    assert families.for_model(model.model_copy(update={"bert_token_types": 2}))[1] == "MegatronBertForMaskedLM"
