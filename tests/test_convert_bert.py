"""`megacli convert` for BERT: a tiny random MegatronBertForPreTraining (pre-LN, Megatron-LM's BERT
layout) built from a config dict. Checked: HF -> megacli -> HF is bitwise with the same config;
the converted model's masked-LM and next-sentence logits (a padded batch with both token types)
equal Hugging Face's at TP=1 and at TP=2 × PP=2; post-LN BertForPreTraining is refused with the
reason."""

from __future__ import annotations

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


def _build_hf(path: Path):
    from transformers import BertTokenizerFast, MegatronBertConfig, MegatronBertForPreTraining

    torch.manual_seed(0)
    model = MegatronBertForPreTraining(MegatronBertConfig(**CONFIG, architectures=["MegatronBertForPreTraining"]))
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
    return out.prediction_logits.float(), out.seq_relationship_logits.float()


def _megacli_logits(ckpt_dir: Path):
    """(masked-LM logits, binary logits) of a BERT checkpoint through the engine under the current
    parallel state; None except on the last pipeline stage's first TP rank."""
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
            return logits.sum() * 0, torch.tensor(1), {"logits": full.detach(), "binary": binary.detach()}

        return output, collect

    with torch.no_grad():
        reports = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([(toks, attend, types)]),
                                              model=chunks[0], num_microbatches=1, seq_length=toks.shape[1],
                                              micro_batch_size=toks.shape[0], forward_only=True)
    if not ps.is_pipeline_last_stage() or ps.get_tensor_model_parallel_rank() != 0:
        return None
    return reports[0]["logits"][..., : recipe.model.vocab_size].float(), reports[0]["binary"].float()


def _convert_both_ways(rank, world, root: str) -> dict:
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    root = Path(root)
    ref = _hf_logits(_build_hf(root / "hf"))
    torch.save(ref, root / "hf_logits.pt")
    out = cm.round_trip(root, parallel=ParallelSection(tensor=2, pipeline=2))
    distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu"), seed=0)
    ours = _megacli_logits(root / "mc")
    distributed.teardown()
    out["tp1"] = [cm.max_diff(x, y) for x, y in zip(ours, ref)]
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("convert_bert")
    return root, spawn(_convert_both_ways, 1, str(root), timeout=900)[0]


@pytest.mark.slow
def test_round_trip_is_bitwise_and_logits_match_at_tp1(converted):
    _, out = converted
    assert out["same_keys"] and out["bitwise"]
    src, back = out["config"]
    assert src == back
    assert max(out["tp1"]) < TOL, out["tp1"]


def _logits_tp2_pp2(rank, world, root: str):
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    distributed.setup(parallel=ParallelSection(tensor=2, pipeline=2), launch=LaunchSection(device="cpu", nproc=4), seed=0)
    out = _megacli_logits(Path(root) / "mc")
    distributed.teardown()
    return out


@pytest.mark.slow
def test_logits_match_hf_at_tp2_pp2(converted):
    from tests._dist import spawn

    root, _ = converted
    results = [r for r in spawn(_logits_tp2_pp2, 4, str(root)) if r is not None]
    assert len(results) == 1, "exactly one rank (last stage, TP rank 0) reports logits"
    ref = torch.load(root / "hf_logits.pt")
    assert [cm.max_diff(x, y) < TOL for x, y in zip(results[0], ref)] == [True, True]


def test_post_ln_bert_is_refused_with_the_reason(tmp_path):
    from transformers import BertConfig, BertForPreTraining

    from megacli.convert import convert
    from megacli.errors import UserError

    BertForPreTraining(BertConfig(**CONFIG, architectures=["BertForPreTraining"])).save_pretrained(tmp_path / "hf")
    with pytest.raises(UserError) as err:
        convert(tmp_path / "hf", tmp_path / "mc", say=lambda *_: None)
    assert "post-LN" in str(err.value) and "MegatronBertForPreTraining" in str(err.value)
