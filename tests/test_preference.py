"""Preference tuning (`preference:` in a finetune recipe): the pair data (TRL's tokenization and
truncation, bad records by file:line), the objectives against TRL (loss, rewards and gradients of
named weights in fp32), the step-0 property, and the reference modes agreeing with each other."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megacli.checkpoint.source import Source
from megacli.data.preference import PreferenceDataset, PreferenceStats, read_pairs, tokenize_pair
from megacli.data.tokenizers import load_tokenizer
from megacli.errors import UserError

BYTE = load_tokenizer(type="byte", path=None)

PAIRS = [{"prompt": "the quick brown", "chosen": " fox jumps", "rejected": " dog over the lazy"},
         {"prompt": "over the", "chosen": " lazy dog", "rejected": " quick fox"},
         {"prompt": "the lazy", "chosen": " dog", "rejected": " brown fox jumps over"},
         {"prompt": "jumps over", "chosen": " the lazy dog", "rejected": " the"}]


# CPOTrainer puts the tokenizer's BOS before a prompt that lacks one; these prompts start with it.
BOS_PAIRS = [dict(p, prompt="<|endoftext|>" + p["prompt"]) for p in PAIRS]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def dataset(pairs, seq_length=16, max_length=None, max_prompt_length=None):
    stats = PreferenceStats(pairs=len(pairs))
    tokenized = [(f"x:{i}", tokenize_pair(p, BYTE, "plain")) for i, p in enumerate(pairs)]
    ds = PreferenceDataset(tokenized, seq_length=seq_length, pad_id=BYTE.pad, max_length=max_length or seq_length + 1,
                           max_prompt_length=max_prompt_length, stats=stats)
    return ds, stats


# ---------------------------------------------------------------- data


def test_a_pair_by_hand():
    ds, stats = dataset([{"prompt": "ab", "chosen": "c", "rejected": "de"}], seq_length=6)
    s = ds[0]
    a, b, c, d, e = (ord(x) for x in "abcde")
    eod, pad = BYTE.eod, BYTE.pad
    assert s["tokens"].tolist() == [[a, b, c, eod, pad, pad], [a, b, d, e, eod, pad]]
    assert s["labels"].tolist() == [[b, c, eod, pad, pad, pad], [b, d, e, eod, pad, pad]]
    # Only completion tokens (and the appended end of document) are scored.
    assert s["loss_mask"].tolist() == [[0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0]]
    assert stats.describe("train").startswith("train: 1 pairs -> 1 kept; 5 of 9 tokens scored")


def test_chat_messages_use_the_template_and_score_the_assistant_turn():
    record = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yo"}],
              "rejected": [{"role": "assistant", "content": "no"}]}
    pair = tokenize_pair(record, BYTE, "chatml")
    text = lambda ids: bytes(ids).decode()  # noqa: E731
    assert text(pair.prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert text(pair.chosen) == "yo<|im_end|>\n" and text(pair.rejected) == "no<|im_end|>\n"


def test_truncation_follows_trl_and_is_counted():
    long_prompt = {"prompt": "p" * 20, "chosen": "c", "rejected": "r"}
    long_answer = {"prompt": "ab", "chosen": "c" * 30, "rejected": "r"}
    ds, stats = dataset([long_prompt, long_answer, {"prompt": "ab", "chosen": "c", "rejected": "d"}], seq_length=16,
                        max_length=12)
    assert (stats.dropped, stats.truncated, len(ds)) == (1, 1, 2)  # the prompt fills max_length: dropped
    assert int((ds.samples[0, 0, 1] >= 0).sum()) == 12  # keep_start: the first 12 tokens
    ds, stats = dataset([long_prompt], seq_length=16, max_prompt_length=4)
    assert stats.prompts_truncated == 1 and ds[0]["loss_mask"][0].tolist()[:5] == [0, 0, 0, 1, 1]
    with pytest.raises(UserError, match="no preference pair is left"):
        dataset([long_prompt], seq_length=16, max_length=12)


def test_bad_records_are_named_by_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(PAIRS[0]) + "\n\n" + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(UserError, match=r"p.jsonl:3: missing rejected"):
        read_pairs(str(f))
    f.write_text(json.dumps({"prompt": "a", "chosen": "", "rejected": "x"}) + "\n")
    with pytest.raises(UserError, match=r"p.jsonl:1: chosen is empty"):
        read_pairs(str(f))
    f.write_text(json.dumps({"prompt": "a", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "y"}) + "\n")
    with pytest.raises(UserError, match=r"p.jsonl:1: prompt, chosen and rejected must all be strings"):
        read_pairs(str(f))
    f.write_text("{oops\n")
    with pytest.raises(UserError, match=r"p.jsonl:1: not valid JSON"):
        read_pairs(str(f))


def test_a_local_hugging_face_dataset_reads_like_jsonl(tmp_path):
    from datasets import Dataset

    Dataset.from_list(PAIRS).save_to_disk(str(tmp_path / "ds"))
    assert [r for _, r in read_pairs(str(tmp_path / "ds"))] == PAIRS
    Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": ""}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(UserError, match=r"bad\[row 0\]: rejected is empty"):
        read_pairs(str(tmp_path / "bad"))


def test_a_malformed_record_stops_finetune_with_exit_2(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"prompt": "a", "chosen": 3, "rejected": "b"}) + "\n")
    out = subprocess.run([sys.executable, "-m", "megacli", "finetune", "--set", f"preference.train={bad}",
                          "--set", "tokenizer.type=byte", "--set", "model.num_layers=2", "--set", "model.hidden_size=32",
                          "--set", "model.num_attention_heads=4", "--set", "model.seq_length=16",
                          "--set", "launch.device=cpu", "--set", "train.iters=1", "--set", "train.global_batch_size=1",
                          "--set", "train.micro_batch_size=1", "--set", f"run.dir={tmp_path / 'run'}",
                          "--set", "checkpoint.pretrained=none_needed_here"],
                         capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                           "MEGACLI_IN_PROCESS": "1"})
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"{bad}:2: chosen must be a string" in out.stdout + out.stderr, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- against TRL


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random HF Llama with a tokenizer (root/hf), its megacli conversion (root/base) and the pairs."""
    from megacli.convert import convert
    from tests import _convert_models as cm

    root = tmp_path_factory.mktemp("pref")
    cm.build_hf("llama_tied_gqa", root / "hf", with_tokenizer=True)
    convert(Source(root / "hf"), root / "base")
    write_jsonl(root / "pairs.jsonl", PAIRS)
    write_jsonl(root / "pairs_bos.jsonl", BOS_PAIRS)
    write_jsonl(root / "pair_one.jsonl", PAIRS[:1])
    return root


NAMED = {"model.norm.weight": "decoder.final_layernorm.weight",
         "model.layers.1.mlp.down_proj.weight": "decoder.layers.1.mlp.linear_fc2.weight",
         "model.embed_tokens.weight": "embedding.word_embeddings.weight"}
SCALE = 1.25  # the policy's final norm, scaled in both worlds so that it differs from the reference


def _megacli_steps(rank, world, root: str, cases: dict, scale: float):
    """For each case: one forward/backward of its pairs (one micro-batch) from the converted
    checkpoint, the reference being the checkpoint itself and the policy's final norm scaled: the
    step's metrics and the named weights' gradients."""
    from megacli.engine import checkpoint, distributed
    from megacli.engine.loop import build_trainer, data_iterators, run_schedule
    from megacli.engine.metrics import loss_metrics
    from megacli.engine.models.common import unwrap
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    base = Path(root) / "base"
    out, runtime = {}, None
    for name, c in cases.items():
        n = len(c["pairs"])
        recipe = load(TrainingRecipe, base / "iter_0000000" / "recipe.yaml", [
            f"preference.train={Path(root) / c['data']}", "preference.valid_fraction=0", f"checkpoint.pretrained={base}",
            "checkpoint.resume=none", "launch.device=cpu", f"train.micro_batch_size={n}", f"train.global_batch_size={n}",
            "train.precision=fp32", f"run.dir={Path(root) / 'run'}", f"preference.loss={c['loss']}",
            f"preference.beta={c['beta']}", f"preference.gamma={c['gamma']}",
            f"preference.label_smoothing={c['label_smoothing']}"])
        if runtime is None:
            runtime = distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=recipe.train.seed)
        trainer, _ = build_trainer(recipe, runtime)
        checkpoint.load(source=Source(checkpoint.find_checkpoint(base)), chunks=trainer.chunks, optimizer=trainer.optimizer,
                        scheduler=trainer.scheduler, load_optimizer=False)
        net = unwrap(trainer.chunks[0])
        with torch.no_grad():
            net.decoder.final_layernorm.weight.mul_(scale)
        for chunk in trainer.chunks:
            chunk.zero_grad_buffer()
        metrics = loss_metrics(run_schedule(trainer, data_iterators(trainer, trainer.train_data, 0), forward_only=False))
        params = dict(net.named_parameters())
        out[name] = metrics, {p: params[p].main_grad.detach().clone() for p in NAMED.values()}
    distributed.teardown()
    return out


def _trl_step(root: Path, pairs: list[dict], loss: str, beta: float, label_smoothing: float, gamma: float,
              scale: float):
    """TRL's loss, rewards and the named weights' gradients for the same pairs and policy: DPOTrainer
    (reference log-probabilities of the unscaled model given as precomputed), or CPOTrainer for simpo."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from tests import _convert_models as cm

    tok = AutoTokenizer.from_pretrained(root / "hf")
    tok.pad_token = tok.eos_token
    policy = cm.load_hf(root / "hf")
    with torch.no_grad():
        policy.model.norm.weight.mul_(scale)
    policy.train()
    if loss == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(output_dir=str(root / "trl"), loss_type="simpo", cpo_alpha=0.0, beta=beta, simpo_gamma=gamma,
                         label_smoothing=label_smoothing, report_to=[], use_cpu=True, max_length=None)
        trainer = CPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tok)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])
        value, metrics = trainer.get_batch_loss_metrics(policy, batch)
        value.backward()
        return (float(value), metrics["rewards/chosen"], metrics["rewards/rejected"],
                {k: p.grad for k, p in policy.named_parameters() if k in NAMED}, None)
    from trl import DPOConfig, DPOTrainer

    loss_type = {"dpo": "sigmoid" if not label_smoothing else "aot", "ipo": "ipo"}[loss]
    args = DPOConfig(output_dir=str(root / "trl"), loss_type=[loss_type], beta=beta, label_smoothing=label_smoothing,
                     report_to=[], use_cpu=True, max_length=None)
    trainer = DPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tok)
    rows = [trainer.train_dataset[i] for i in range(len(pairs))]
    batch = trainer.data_collator(rows)
    # The reference: the starting weights, scored by a plain forward and given as precomputed.
    reference = cm.load_hf(root / "hf")
    with torch.no_grad():
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    token_logps = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    ref = (token_logps * batch["completion_mask"][:, 1:]).sum(-1)
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref.chunk(2)
    trainer.precompute_ref_logps = True
    value = trainer._compute_loss(policy, batch, return_outputs=False)
    value.backward()
    m = trainer._metrics["train"]
    ids = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows]
    return float(value), m["rewards/chosen"][-1], m["rewards/rejected"][-1], \
        {k: p.grad for k, p in policy.named_parameters() if k in NAMED}, ids


# TRL 1.16's sigmoid loss has no label smoothing; its "aot" loss is the label-smoothed sigmoid of the
# sorted log-ratio margins, which for a single pair is cDPO: the smoothed case runs one pair.
CASES = {"dpo": dict(loss="dpo", beta=0.1, label_smoothing=0.0, gamma=0.5, data="pairs.jsonl", pairs=PAIRS),
         "cdpo": dict(loss="dpo", beta=0.1, label_smoothing=0.2, gamma=0.5, data="pair_one.jsonl", pairs=PAIRS[:1]),
         "ipo": dict(loss="ipo", beta=0.5, label_smoothing=0.0, gamma=0.5, data="pairs.jsonl", pairs=PAIRS),
         "simpo": dict(loss="simpo", beta=2.0, label_smoothing=0.0, gamma=0.5, data="pairs_bos.jsonl", pairs=BOS_PAIRS)}


@pytest.fixture(scope="module")
def megacli_steps(tiny_llama) -> dict:
    from tests._dist import spawn

    return spawn(_megacli_steps, 1, str(tiny_llama), CASES, SCALE)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_loss_rewards_and_gradients_equal_trl(tiny_llama, megacli_steps, case):
    c = CASES[case]
    metrics, grads = megacli_steps[case]
    value, chosen, rejected, trl_grads, ids = _trl_step(tiny_llama, c["pairs"], c["loss"], c["beta"],
                                                        c["label_smoothing"], c["gamma"], SCALE)
    if ids is not None:  # the same token ids as TRL's tokenization
        hf = load_tokenizer(type="huggingface", path=str(tiny_llama / "hf"))
        ours = [tokenize_pair(p, hf, "plain") for p in c["pairs"]]
        assert [(p.prompt, p.chosen, p.rejected) for p in ours] == ids
    assert abs(metrics["loss"] - value) < 1e-5, (metrics["loss"], value)
    assert abs(value - math.log(2)) > 1e-3 or c["loss"] != "dpo", "the policy must differ from the reference"
    assert abs(metrics["rewards/chosen"] - chosen) < 1e-5, (metrics["rewards/chosen"], chosen)
    assert abs(metrics["rewards/rejected"] - rejected) < 1e-5, (metrics["rewards/rejected"], rejected)
    assert abs(chosen) > 1e-4 and abs(rejected) > 1e-4
    for hf_name, name in NAMED.items():
        ours, theirs = grads[name], trl_grads[hf_name]
        ours = ours[: theirs.shape[0]]  # the padded vocabulary's extra rows
        assert float(theirs.abs().max()) > 1e-6, hf_name
        assert float((ours - theirs).abs().max()) < 1e-5, (hf_name, float((ours - theirs).abs().max()))


# ---------------------------------------------------------------- step 0 and the reference modes


def _three_steps(rank, world, root: str):
    """Three DPO steps from the converted checkpoint with each reference mode: full weights with
    copy and precompute, LoRA with copy and base. Returns each run's per-step metrics."""
    from megatron.core import parallel_state as ps

    from megacli.engine import checkpoint, distributed
    from megacli.engine.loop import build_trainer, data_iterators, precomputed_sets, train_step
    from megacli.engine.preference import precompute
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    base = Path(root) / "base"
    runs = {"copy": [], "precompute": [], "lora_copy": ["lora.rank=4"], "lora_base": ["lora.rank=4"]}
    out, runtime = {}, None
    for name, extra in runs.items():
        mode = name.removeprefix("lora_")
        recipe = load(TrainingRecipe, base / "iter_0000000" / "recipe.yaml", [
            f"preference.train={Path(root) / 'pairs.jsonl'}", "preference.valid_fraction=0", f"preference.reference={mode}",
            f"checkpoint.pretrained={base}", "checkpoint.resume=none", "launch.device=cpu", "train.micro_batch_size=1",
            "train.global_batch_size=2", "train.precision=fp32", f"run.dir={Path(root) / ('run_' + name)}",
            "optim.lr=2e-2", "optim.decay_style=constant", "optim.min_lr=0", "optim.warmup_iters=0", *extra])
        if runtime is None:
            runtime = distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=recipe.train.seed)
        else:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=1)
        trainer, _ = build_trainer(recipe, runtime)
        start = checkpoint.find_checkpoint(base)
        checkpoint.load(source=Source(start), chunks=trainer.chunks, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                        load_optimizer=False)
        if mode == "precompute":
            precompute(trainer, precomputed_sets(trainer), pretrained=start, fresh=True, say=lambda text: None)
            out["bad caches"], said = _bad_caches(Path(recipe.run.dir) / "preference_cache",
                                                  lambda say: precompute(trainer, precomputed_sets(trainer),
                                                                         pretrained=start, fresh=True, say=say))
            out["cached"] = said
        iterators = data_iterators(trainer, trainer.train_data, start_sample=0)
        out[name] = [train_step(trainer, iterators)[0] for _ in range(3)]
    distributed.teardown()
    out["cache"] = sorted(p.name for p in (Path(root) / "run_precompute" / "preference_cache").iterdir())
    return out


def _bad_caches(cache: Path, run_precompute) -> tuple[dict[str, str], list[str]]:
    """Each kind of bad file put in place of the reference log-probabilities precompute cached, and
    what precompute then did (its error, or "accepted"); then the real cache put back and read: what
    precompute said."""
    from megacli.errors import UserError

    (path,) = cache.iterdir()
    good = path.read_bytes()
    real = np.load(path)

    def saved(array) -> bytes:
        np.save(cache / "x.npy", array, allow_pickle=True)
        return (cache / "x.npy").read_bytes()

    bad = {"truncated": good[:-8], "not npy": b"{}", "empty": b"", "object dtype": saved(real.astype(object)),
           "float32": saved(real.astype(np.float32)), "fewer pairs": saved(real[:-1]),
           "three columns": saved(np.zeros((len(real), 3))), "nan": saved(np.where(real < 0, np.nan, real))}
    (cache / "x.npy").unlink()
    outcome = {}
    for name, content in bad.items():
        path.write_bytes(content)
        try:
            run_precompute(lambda text: None)
            outcome[name] = "accepted"
        except UserError as exc:
            outcome[name] = str(exc)
    path.write_bytes(good)
    said = []
    run_precompute(said.append)
    return outcome, said


def test_step_zero_is_log_2_and_the_reference_modes_agree(tiny_llama):
    """With the policy equal to its reference the first DPO loss is exactly log 2 (in fp32) and
    every reward 0; precompute gives copy's losses, and with LoRA base (adapters off) gives a
    frozen copy's."""
    from tests._dist import spawn

    r = spawn(_three_steps, 1, str(tiny_llama))[0]
    for name in ("copy", "precompute", "lora_copy", "lora_base"):
        first = r[name][0]
        assert first["loss"] == float(np.float32(math.log(2))), (name, first["loss"])
        assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margin"] == 0.0, first
        assert r[name][-1]["loss"] != first["loss"]  # the later steps moved away from the reference
    for a, b in (("copy", "precompute"), ("lora_copy", "lora_base")):
        la, lb = [m["loss"] for m in r[a]], [m["loss"] for m in r[b]]
        np.testing.assert_allclose(la, lb, rtol=0, atol=1e-6, err_msg=f"{a} vs {b}")
    assert [m["loss"] for m in r["copy"]] != [m["loss"] for m in r["lora_copy"]]  # LoRA trains something else
    assert len(r["cache"]) == 1 and r["cache"][0].startswith("train-")
    for name, outcome in r["bad caches"].items():  # refused, never taken as the cache
        assert outcome.startswith(str(tiny_llama / "run_precompute" / "preference_cache" / r["cache"][0]) + ": "), name
        assert outcome.endswith("Delete it (it is rebuilt)"), (name, outcome)
    assert "an array of Python objects" in r["bad caches"]["object dtype"]
    assert "(expected [4, 2], float64)" in r["bad caches"]["three columns"]
    assert r["cached"] == [f"reference log-probabilities of train: {tiny_llama}/run_precompute/preference_cache/"
                           f"{r['cache'][0]} (cached)"]


def test_the_dry_run_counts_the_reference_model():
    """The memory estimate: a copy reference adds a second set of weights, precompute and base none;
    a micro-batch of pairs holds twice the sequences (activations and logits)."""
    from megacli import plan
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    common = ["tokenizer.type=byte", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
              "model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2"]
    mem = {mode: plan.estimate(load(TrainingRecipe, None, [*common, "preference.train=x.jsonl",
                                                           f"preference.reference={mode}"]), BYTE.vocab_size)[1]
           for mode in ("copy", "precompute")}
    sft = plan.estimate(load(TrainingRecipe, None, [*common, "sft.train=x.jsonl"]), BYTE.vocab_size)[1]
    assert mem["copy"].reference_gib == mem["copy"].weights_gib > 0
    assert mem["precompute"].reference_gib == 0
    assert mem["copy"].total_gib - mem["precompute"].total_gib == pytest.approx(mem["copy"].weights_gib)
    assert mem["copy"].activations_gib == pytest.approx(2 * sft.activations_gib)
    assert mem["copy"].logits_gib == pytest.approx(2 * sft.logits_gib)
