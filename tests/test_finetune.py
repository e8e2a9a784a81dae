"""`megacli finetune` on instruction data: the loss mask (checked by hand), packing (positions and
attention restart per example: a packed example's logits equal its logits alone), the data
summary and bad records, and end to end from a converted Hugging Face model: validation loss
falls, and the finetuned checkpoint exported back to Hugging Face gives the engine's logits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megacli.checkpoint.source import Source
from megacli.data.sft import SftDataset, SftStats, read_records, render, tokenize
from megacli.data.tokenizers import load_tokenizer
from megacli.errors import UserError
from tests.conftest import megacli, megacli_here

BYTE = load_tokenizer(type="byte", path=None)
EOD, PAD = BYTE.eod, BYTE.pad


def samples(records, seq_length=12, packing=True, too_long="truncate"):
    stats = SftStats(examples=len(records))
    ds = SftDataset([tokenize(r, BYTE, "plain") for r in records], seq_length=seq_length, pad_id=PAD, packing=packing,
                    too_long=too_long, stats=stats)
    return ds, stats


def test_loss_mask_by_hand():
    ds, stats = samples([{"prompt": "ab", "response": "cd"}], seq_length=7)
    s = ds[0]
    a, b, c, d = (ord(x) for x in "abcd")
    assert s["tokens"].tolist() == [a, b, c, d, EOD, PAD, PAD]
    assert s["labels"].tolist() == [b, c, d, EOD, PAD, PAD, PAD]
    # Predicting b (prompt) carries no loss; c, d and the end of document do; padding does not.
    assert s["loss_mask"].tolist() == [0, 1, 1, 1, 0, 0, 0]
    assert stats.describe("train") == ("train: 1 examples -> 1 sequences; 3 of 5 tokens carry loss (60.0%); "
                                       "0 truncated, 0 dropped as too long")
    chat = [piece for piece in render({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                                      "chatml")]
    assert chat == [("<|im_start|>user\n", False), ("hi<|im_end|>\n", False), ("<|im_start|>assistant\n", False),
                    ("yo<|im_end|>\n", True)]


def test_the_tokenizers_chat_template_is_used_when_it_has_one(tmp_path):
    from megacli.data.sft import build_sft_datasets, chat_template_of
    from megacli.recipe.finetune_sections import SFTSection

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}",
        "bos_token": "[", "eos_token": "]"}))
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert render(record, "tokenizer", chat_template_of(str(tmp_path))) == [("[<user>q]", False), ("<assistant>a]", True)]
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(record) + "\n")
    sft = SFTSection(train=str(data), valid=str(data))
    train, _, summary = build_sft_datasets(sft=sft, tokenizer=BYTE, tokenizer_path=str(tmp_path), seq_length=32, seed=0)
    assert "(template: tokenizer)" in summary[0]
    text = bytes(t for t in train[0]["tokens"].tolist() if t < 256).decode()
    assert text == "[<user>q]<assistant>a]"
    # Loss on "<assistant>a]" and the end of document; none on the user turn.
    assert int(train[0]["loss_mask"].sum()) == len("<assistant>a]") + 1
    _, _, summary = build_sft_datasets(sft=sft, tokenizer=BYTE, tokenizer_path=None, seq_length=32, seed=0)
    assert "(template: plain)" in summary[0]


def test_packing_restarts_positions_and_separates_examples():
    ds, stats = samples([{"prompt": "ab", "response": "c"}, {"prompt": "x", "response": "yz"}, {"prompt": "pq", "response": "r"}],
                        seq_length=12)
    assert len(ds) == 1 and stats.sequences == 1  # 4 + 4 + 4 = 12 <= 13 tokens
    s = ds[0]
    assert s["segments"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert s["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]
    # The last token of an example does not learn to predict the next example's first token.
    assert s["loss_mask"].tolist() == [0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 0]
    unpacked, _ = samples([{"prompt": "ab", "response": "c"}, {"prompt": "x", "response": "yz"}], packing=False)
    assert len(unpacked) == 2 and (unpacked[1]["segments"][:4] == 0).all() and (unpacked[1]["segments"][4:] == -1).all()


def test_too_long_examples_truncated_or_dropped_and_counted():
    long = {"prompt": "p", "response": "r" * 30}
    ds, stats = samples([long, {"prompt": "a", "response": "b"}], seq_length=8)
    assert stats.truncated == 1 and stats.dropped == 0 and len(ds[0]["tokens"]) == 8
    ds, stats = samples([long, {"prompt": "a", "response": "b"}], seq_length=8, too_long="drop")
    assert stats.dropped == 1 and stats.examples == 2 and stats.sequences == 1
    with pytest.raises(UserError, match="no finetuning example is left"):
        samples([long], seq_length=8, too_long="drop")


def test_bad_records_are_named_by_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "response": "b"}\n\n{"prompt": "a"}\n')
    with pytest.raises(UserError, match=r"d.jsonl:3: expected string fields prompt and response"):
        read_records(str(f))
    f.write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(UserError, match=r"d.jsonl:1: no assistant message"):
        read_records(str(f))
    f.write_text("{oops\n")
    with pytest.raises(UserError, match=r"d.jsonl:1: not valid JSON"):
        read_records(str(f))


# ---------------------------------------------------------------- packed = alone, through the model


def _packed_vs_alone(rank, world, position_embedding: str):
    from megacli.engine import distributed
    from megacli.engine.models import build_model
    from megacli.engine.models.config import transformer_config
    from megacli.engine.models.init import init_weights
    from megacli.engine.steps import example_mask
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    recipe = base.load(TrainingRecipe, None, [
        "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
        f"model.position_embedding={position_embedding}", "launch.device=cpu", "tokenizer.type=byte", "data.mock=true"])
    distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=0)
    config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="fp32", on_cuda=False)
    chunks = build_model(recipe=recipe, config=config, vocab_size=BYTE.vocab_size)
    init_weights(chunks, seed=3, std=0.02, num_layers=2, gated=False)
    model = chunks[0].eval()
    ds, _ = samples([{"prompt": "hello ", "response": "world"}, {"prompt": "ab", "response": "cd"}], seq_length=16)
    packed = {k: torch.as_tensor(v)[None] for k, v in ds[0].items()}
    alone_ds, _ = samples([{"prompt": "ab", "response": "cd"}], seq_length=16)
    alone = {k: torch.as_tensor(v)[None] for k, v in alone_ds[0].items()}
    with torch.no_grad():
        lp = model(packed["tokens"], packed["position_ids"], example_mask(packed))
        la = model(alone["tokens"], alone["position_ids"], example_mask(alone))
        unmasked = model(packed["tokens"], packed["position_ids"], None)
    start = int((packed["segments"][0] == 0).sum())  # where the second example begins
    n = int((packed["segments"][0] == 1).sum())  # its tokens in the packed input
    distributed.teardown()
    return (float((lp[0, start:start + n] - la[0, :n]).abs().max()),
            float((unmasked[0, start:start + n] - la[0, :n]).abs().max()))


@pytest.mark.slow
@pytest.mark.parametrize("position_embedding", ["rope", "learned"])
def test_a_packed_example_has_its_logits_alone(position_embedding):
    from tests._dist import spawn

    packed, unmasked = spawn(_packed_vs_alone, 1, position_embedding)[0]
    assert packed < 1e-5, packed
    assert unmasked > 1e-3, "without the example mask the first example would leak in (the check can fail)"


# ---------------------------------------------------------------- end to end


def _export_parity(rank, world, ckpt: str, hf_dir: str):
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection
    from tests import _convert_models as cm

    toks = cm.tokens()
    distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu"), seed=0)
    ours = cm.megacli_logits(Path(ckpt), toks)
    distributed.teardown()
    return float((cm.hf_logits(cm.load_hf(Path(hf_dir)), toks) - ours).abs().max())


@pytest.fixture(scope="module")
def converted_llama(tmp_path_factory) -> Path:
    """A tiny random Hugging Face Llama with a tokenizer (root/hf), its `megacli convert` (root/base)
    and a small instruction set (root/sft.jsonl): half prompt/response pairs, half chats."""
    import random

    from tests import _convert_models as cm

    root = tmp_path_factory.mktemp("llama")
    cm.build_hf("llama_tied_gqa", root / "hf", with_tokenizer=True)
    out = megacli_here("convert", str(root / "hf"), str(root / "base"))
    assert out.returncode == 0, out.stderr[-2000:]
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog".split()
    with (root / "sft.jsonl").open("w") as f:
        for i in range(300):
            xs = " ".join(rng.choice(words) for _ in range(rng.randint(2, 5)))
            record = ({"prompt": f"repeat: {xs}\n", "response": xs} if i % 2 else
                      {"messages": [{"role": "user", "content": f"repeat: {xs}"}, {"role": "assistant", "content": xs}]})
            f.write(json.dumps(record) + "\n")
    return root


@pytest.mark.slow
def test_finetune_from_a_converted_model_then_export(tmp_path, converted_llama):
    base = converted_llama / "base"
    sets = ["sft.train=" + str(converted_llama / "sft.jsonl"), "sft.template=chatml", f"checkpoint.pretrained={base}",
            "checkpoint.resume=auto", f"checkpoint.dir={tmp_path / 'ft'}", f"run.dir={tmp_path / 'run'}",
            "train.iters=24", "train.micro_batch_size=2", "train.global_batch_size=8", "train.eval_interval=6",
            "train.eval_iters=2", "train.log_interval=4", "optim.lr=3e-3", "optim.warmup_iters=2", "launch.nproc=2",
            "parallel.tensor=2"]
    recipe = base / "iter_0000000" / "recipe.yaml"
    out = megacli("finetune", str(recipe), *[x for s in sets for x in ("--set", s)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"train: \d+ examples -> \d+ sequences; \d+ of \d+ tokens carry loss", out.stdout), out.stdout
    assert "starting from the weights of" in out.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(valid) >= 2 and valid[-1] < valid[0] - 0.5, valid

    out = megacli_here("convert", str(tmp_path / "ft"), str(tmp_path / "hf_out"))
    assert out.returncode == 0, out.stderr[-2000:]
    from tests._dist import spawn

    diff = spawn(_export_parity, 1, str(tmp_path / "ft"), str(tmp_path / "hf_out"))[0]
    assert diff < 1e-4, diff


# ---------------------------------------------------------------- LoRA


def _lora_tp2_then_tp1(rank, world, base: str, data: str, out: str, sp: bool = True):
    """Three LoRA steps at TP=2 with sequence parallelism, save, two more; then, in the same
    processes at TP=1 × DP=2, resume from that checkpoint and take the same two steps."""
    from megatron.core import parallel_state as ps

    from megacli.engine import checkpoint, distributed
    from megacli.engine.loop import build_trainer, data_iterators, train_step
    from megacli.engine.models.common import unwrap
    from megacli.recipe.base import dump, load
    from megacli.recipe.pretrain import TrainingRecipe
    from tests import _convert_models as cm

    def recipe_at(tp: int):
        return load(TrainingRecipe, Path(base) / "iter_0000000" / "recipe.yaml", [
            f"parallel.tensor={tp}", f"parallel.sequence_parallel={sp and tp > 1}", "launch.nproc=2", "launch.device=cpu",
            f"sft.train={data}", "sft.template=chatml", f"checkpoint.pretrained={base}", "checkpoint.resume=none",
            "lora.rank=4", "lora.alpha=8", "train.micro_batch_size=2", "train.global_batch_size=4", "train.iters=10",
            "train.precision=fp32", "optim.lr=2e-2", "optim.decay_style=constant", "optim.min_lr=0"])

    def steps(trainer, iterators, n):
        return [train_step(trainer, iterators)[0]["loss"] for _ in range(n)]

    recipe = recipe_at(2)
    runtime = distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=recipe.train.seed)
    trainer, _ = build_trainer(recipe, runtime)
    pretrained = checkpoint.find_checkpoint(base)
    checkpoint.load(source=Source(pretrained), chunks=trainer.chunks, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                    load_optimizer=False)
    net = unwrap(trainer.chunks[0])
    frozen_before = {n: p.detach().clone() for n, p in net.named_parameters() if not p.requires_grad}
    trainable = sorted(n for n, p in net.named_parameters() if p.requires_grad)
    iterators = data_iterators(trainer, trainer.train_data, start_sample=0)
    first = steps(trainer, iterators, 3)
    saved = checkpoint.save(ckpt_dir=out, iteration=3, consumed_samples=12, chunks=trainer.chunks, optimizer=trainer.optimizer,
                            scheduler=trainer.scheduler, recipe_yaml=dump(recipe), lora_base=pretrained)
    later_tp2 = steps(trainer, iterators, 2)
    frozen = all(torch.equal(p, frozen_before[n]) for n, p in net.named_parameters() if n in frozen_before)
    toks = cm.tokens()
    logits_tp2 = cm.megacli_logits(saved, toks)  # a fresh LoRA model loaded from base + adapters

    ps.destroy_model_parallel()
    recipe = recipe_at(1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    trainer, _ = build_trainer(recipe, runtime)
    restored = checkpoint.load(source=Source(saved), chunks=trainer.chunks, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                               load_optimizer=True)
    later_tp1 = steps(trainer, data_iterators(trainer, trainer.train_data, start_sample=restored.consumed_samples), 2)
    logits_tp1 = cm.megacli_logits(saved, toks)
    distributed.teardown()
    return dict(first=first, later_tp2=later_tp2, later_tp1=later_tp1, frozen=frozen, trainable=trainable,
                logits_tp2=logits_tp2, logits_tp1=logits_tp1, saved=str(saved))


@pytest.mark.slow
def test_lora_at_tp2_equals_tp1_and_the_merged_export(tmp_path, converted_llama):
    """LoRA adapters on every attention and MLP linear layer (SwiGLU, GQA) trained at TP=2 with
    sequence parallelism: only adapters train and are saved; resuming at TP=1 continues with the
    same losses; the TP=2 and TP=1 models give the logits of the merged Hugging Face export."""
    from megacli.convert.megatron_io import CheckpointReader
    from tests import _convert_models as cm
    from tests._dist import spawn

    base = converted_llama / "base"
    r = spawn(_lora_tp2_then_tp1, 2, str(base), str(converted_llama / "sft.jsonl"), str(tmp_path / "lora"))[0]
    assert r["frozen"], "a base weight changed"
    assert r["trainable"] and all(n.endswith(("lora_a", "lora_b")) for n in r["trainable"])
    assert len(r["trainable"]) == 2 * 4 * 2  # A and B, four linear layers, two layers
    assert r["first"][-1] < r["first"][0], r["first"]
    np.testing.assert_allclose(r["later_tp1"], r["later_tp2"], rtol=1e-5)  # resume at another layout, same steps

    stored = CheckpointReader(Source(Path(r["saved"]))).canonical_keys()
    assert stored and all(k.endswith(("lora_a", "lora_b")) for k in stored), stored  # adapters only
    assert json.loads((Path(r["saved"]) / "megacli.json").read_text())["lora"]["base"] == str(
        (base / "iter_0000000").resolve())

    out = megacli_here("convert", str(tmp_path / "lora"), str(tmp_path / "hf_lora"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "merged into" in out.stdout
    merged = cm.hf_logits(cm.load_hf(tmp_path / "hf_lora"), cm.tokens())
    before = cm.hf_logits(cm.load_hf(converted_llama / "hf"), cm.tokens())
    assert float((merged - before).abs().max()) > 1e-2, "the adapters changed nothing: the parity would prove nothing"
    assert float((r["logits_tp2"] - merged).abs().max()) < 1e-4
    assert float((r["logits_tp1"] - merged).abs().max()) < 1e-4
