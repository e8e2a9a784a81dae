"""`megacli reshard` on CPU.

One chain of real runs is shared by the checks (the runs dominate the time):

    A  pretrain TP2 × PP2 × DP1 (SP, standard optimizer), 6 steps, checkpoints every 2
    R1 = reshard A@2 -> TP1 × PP1                    (CLI: SRC DST --tensor --pipeline --verify)
    B  pretrain TP1 from R1, steps 3-6, saves at 6
    R2 = reshard R1 -> TP2 × PP1 × DP2 + distributed optimizer   (CLI: a reshard RECIPE)
    C  pretrain TP2 × DP2 (SP, distributed optimizer) from R2, steps 3-6, saves at 6

B and C must reproduce A's losses (the run continued under the old layout). R1/R2 must hold
exactly the entries (keys, global shapes, dtypes, chunking, RNG objects, common state layout)
that the engine itself writes under the new layout (B's and C's own checkpoints).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megacli.checkpoint.source import Source

from tests.conftest import MOCK_GPT, assert_close, cli, layout, losses, pretrain

TINY = [*MOCK_GPT, "model.activation=swiglu"]
RESUMED = range(3, 7)  # the 4 steps after the checkpoint at 2
REL = 1e-4  # another layout: another order of floating-point sums


def run(run_dir: Path, overrides: list[str]) -> dict[int, float]:
    """The losses of `megacli pretrain` of TINY with the overrides."""
    pretrain(run_dir, [*TINY, *overrides])
    return losses(run_dir)


def entries(ckpt: Path) -> dict:
    """What a torch_dist checkpoint holds, without the data: tensors (shape, dtype, chunks) and objects."""
    from megacli.checkpoint.torch_dist import TorchDistReader

    r = TorchDistReader(Source(ckpt))
    return {"tensors": {k: (v.shape, v.dtype, sorted(v.chunks)) for k, v in r.tensors.items()},
            "objects": sorted(r.objects)}


def structure(x):
    if isinstance(x, dict):
        return {k: structure(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [structure(v) for v in x]
    return type(x).__name__


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    out = {"tmp": tmp}
    ck_a = tmp / "ck_a"
    out["A"] = run(tmp / "run_a", layout(tp=2, pp=2, sp=True) + [f"checkpoint.dir={ck_a}", "checkpoint.save_interval=2"])

    r1 = tmp / "r1"
    res = cli("reshard", ck_a / "iter_0000002", r1, "--tensor", "1", "--pipeline", "1", "--verify")
    assert res.exit_code == 0, res.output
    out["r1_output"] = res.output
    out["B"] = run(tmp / "run_b", layout() + [f"checkpoint.resume={r1}", f"checkpoint.dir={tmp / 'ck_b'}"])

    r2 = tmp / "r2"
    recipe = tmp / "to_tp2_dp2.yaml"
    recipe.write_text(f"reshard:\n  source: {r1}\n  output: {r2}\n  tensor: 2\n  data_parallel: 2\n"
                      f"  distributed_optimizer: true\n  sequence_parallel: true\n  verify: true\n")
    res = cli("reshard", recipe)
    assert res.exit_code == 0, res.output
    out["r2_output"] = res.output
    out["C"] = run(tmp / "run_c", layout(tp=2, dp=2, sp=True, dist_opt=True)
                        + [f"checkpoint.resume={r2}", f"checkpoint.dir={tmp / 'ck_c'}"])
    out.update(ck_a=ck_a, r1=r1, r2=r2)
    return out


@pytest.mark.slow
def test_resume_after_reshard_continues_the_old_layouts_loss_curve(chain):
    a = chain["A"]
    assert min(chain["B"]) == 3 and min(chain["C"]) == 3, "training continues after the checkpoint's iteration"
    assert_close(chain["B"], a, RESUMED, REL)  # TP2×PP2 -> TP1×PP1
    assert_close(chain["C"], a, RESUMED, REL)  # -> TP2×PP1×DP2, standard -> distributed optimizer
    assert "verify: OK" in chain["r1_output"] and "verify: OK" in chain["r2_output"]
    assert "standard → distributed" in chain["r2_output"]


@pytest.mark.slow
def test_reshard_writes_what_the_engine_writes_under_the_new_layout(chain):
    """Keys, global shapes, dtypes, chunking, RNG objects and the common state's layout of R1/R2
    equal those of the checkpoints B and C saved themselves in those layouts."""
    import torch

    tmp = chain["tmp"]
    for ours, engines in ((chain["r1"] / "iter_0000002", tmp / "ck_b" / "iter_0000006"),
                          (chain["r2"] / "iter_0000002", tmp / "ck_c" / "iter_0000006")):
        assert entries(ours) == entries(engines)
        assert structure(torch.load(ours / "common.pt", weights_only=False)) == \
            structure(torch.load(engines / "common.pt", weights_only=False))
        ours_meta, engines_meta = (json.loads((p / "megacli.json").read_text()) for p in (ours, engines))
        assert ours_meta["layout"] == engines_meta["layout"]
    meta = json.loads((chain["r2"] / "iter_0000002" / "megacli.json").read_text())
    assert (meta["iteration"], meta["consumed_samples"]) == (2, 16)
    assert meta["resharded_from"]["layout"]["tensor"] == 1
    import yaml

    recipe = yaml.safe_load((chain["r2"] / "iter_0000002" / "recipe.yaml").read_text())
    assert recipe["parallel"]["tensor"] == 2 and recipe["parallel"]["pipeline"] == 1
    assert recipe["parallel"]["distributed_optimizer"] is True and recipe["launch"]["nproc"] == 4
    assert (chain["r2"] / "latest").read_text().strip() == "iter_0000002"


@pytest.mark.slow
def test_optimizer_kind_round_trip_and_vocab_padding(chain):
    """distributed -> standard gives back R1 exactly; TP 4 pads the vocabulary (512 -> 1024 rows)."""
    from megacli.checkpoint.torch_dist import TorchDistReader
    from megacli.recipe.reshard import ReshardSection
    from megacli.reshard import reshard, verify

    tmp = chain["tmp"]
    back = reshard(ReshardSection(source=str(chain["r2"]), output=str(tmp / "r3"), tensor=1, data_parallel=1,
                                  distributed_optimizer=False, sequence_parallel=False))
    assert back.target_layout == "TP 1 × PP 1 × DP 1"
    report = verify(Source(chain["r1"]), Source(tmp / "r3"))
    assert report.ok, report.line()
    assert entries(tmp / "r3" / "iter_0000002") == entries(chain["r1"] / "iter_0000002")

    wide = reshard(ReshardSection(source=str(chain["r1"]), output=str(tmp / "r_tp4"), tensor=4, verify=True))
    assert wide.verified.ok and any("1024 rows" in n for n in wide.notes), wide.notes
    src, dst = TorchDistReader(Source(chain["r1"] / "iter_0000002")), TorchDistReader(Source(tmp / "r_tp4" / "iter_0000002"))
    for key in ("embedding.word_embeddings.weight", "optimizer.state.exp_avg.embedding.word_embeddings.weight"):
        old, new = src.read(key), dst.read(key)
        assert new.shape == (1024, 64) and (new[:512] == old).all() and (new[512:] == 0).all()
        assert len(dst.tensors[key].chunks) == 4  # one per tensor-parallel rank


@pytest.mark.slow
def test_inspect_human_and_json(chain):
    res = cli("reshard", "inspect", chain["r2"])
    assert res.exit_code == 0, res.output
    text = res.output
    for want in ("torch_dist", "TP 2 × PP 1 × DP 2", "distributed optimizer", "iteration", "16 samples consumed",
                 "decoder.layers.mlp.linear_fc1.weight", "4×256×64", "per layer", "param, exp_avg, exp_avg_sq"):
        assert want in text, (want, text)
    res = cli("reshard", "inspect", chain["r2"], "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["format"] == "torch_dist" and info["iteration"] == 2 and info["optimizer"] == "distributed"
    assert info["layout"] == {"tensor": 2, "pipeline": 1, "virtual_pipeline": None, "data": 2, "context": 1}
    rows = {r["name"]: r for r in info["tensors"]}
    fc1 = rows["decoder.layers.mlp.linear_fc1.weight"]
    assert fc1["shape"] == [4, 256, 64] and fc1["dtype"] == "float32" and fc1["chunks"] == 16  # 4 layers × TP2 × (gate, up)
    assert rows["optimizer.state.param.decoder.layers.mlp.linear_fc1.weight"]["kind"] == "optimizer"
    assert info["objects"]["rng_state"] == ["rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2"]
    assert info["recipe"]["parallel"]["tensor"] == 2


@pytest.mark.slow
def test_verify_catches_a_corrupted_shard(chain, tmp_path):
    from megacli.checkpoint.torch_dist import TorchDistReader

    bad = tmp_path / "r2_bad"
    shutil.copytree(chain["r2"], bad)
    it = bad / "iter_0000002"
    reader = TorchDistReader(Source(it))
    # Flip bytes in the middle of the largest stored chunk's data.
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    key, info = max(reader.tensors.items(), key=lambda kv: kv[1].nbytes)
    storage = reader.metadata.storage_data[MetadataIndex(key, torch.Size(info.chunks[0][0]))]
    path = it / storage.relative_path
    data = bytearray(path.read_bytes())
    at = storage.offset + storage.length // 2
    data[at:at + 8] = bytes(b ^ 0xFF for b in data[at:at + 8])
    path.write_bytes(bytes(data))

    res = cli("reshard", "verify", chain["r1"], chain["r2"])
    assert res.exit_code == 0 and res.stdout.startswith("verify: OK"), res.output
    res = cli("reshard", "verify", chain["r1"], bad)
    assert res.exit_code == 1, res.output
    assert res.stdout.startswith("verify: FAILED") and key in res.stdout, res.output


def test_verify_reads_megatron_lm_exports_and_weights_only_targets(chain, tmp_path):
    """verify SRC MLM and MLM SRC (a TE-spec export against a source without extra state) pass; against
    a weights-only checkpoint the missing optimizer state is one line, the weights still compared."""
    from megacli.convert import convert

    mlm, weights = tmp_path / "mlm", tmp_path / "weights"
    res = cli("reshard", chain["r1"], mlm, "--format", "megatron", "--no-progress")
    assert res.exit_code == 0, res.output
    convert(Source(mlm), weights, to="megacli", say=lambda *_: None)
    for src, dst in ((chain["r1"], mlm), (mlm, chain["r1"])):
        res = cli("reshard", "verify", src, dst)
        assert res.exit_code == 0 and res.stdout.startswith("verify: OK"), (src, dst, res.output)
    res = cli("reshard", "verify", chain["r1"], weights)
    text = " ".join(res.stdout.split())
    assert res.exit_code == 1 and text.startswith("verify: FAILED - 1 mismatch(es): "), res.output
    assert "has no optimizer state (weights only): its weights were compared" in text, res.output
    assert not list(tmp_path.glob(".megacli-*")), "the staging directories are removed"


@pytest.mark.slow
def test_refuses_to_overwrite_and_an_interrupted_reshard_leaves_no_checkpoint(chain, tmp_path):
    from megacli.recipe.reshard import ReshardSection
    from megacli.reshard import reshard

    res = cli("reshard", chain["r1"], chain["r2"], "--tensor", "2")
    assert res.exit_code == 2 and "already holds a checkpoint" in res.stderr and "--overwrite" in res.stderr, res.output
    assert "Traceback" not in res.output

    out = tmp_path / "interrupted"

    def progress(description, total):
        seen = []

        def done(key):
            seen.append(key)
            if len(seen) == 5:
                raise KeyboardInterrupt

        return done

    with pytest.raises(KeyboardInterrupt):
        reshard(ReshardSection(source=str(chain["r1"]), output=str(out), tensor=2), progress=progress)
    assert not out.exists()
    leftovers = list(tmp_path.iterdir())
    assert all(not (p / "latest").exists() for p in leftovers)
    assert not list(tmp_path.rglob("megacli.json")), "nothing that looks like a finished checkpoint"

    # --overwrite replaces an existing checkpoint only once the new one is complete.
    target = tmp_path / "again"
    shutil.copytree(chain["r2"], target)
    res = cli("reshard", chain["r1"], target, "--tensor", "2", "--overwrite")
    assert res.exit_code == 0, res.output
    assert json.loads((target / "iter_0000002" / "megacli.json").read_text())["layout"]["data"] == 1
    assert not list(tmp_path.glob(".again.*-tmp")), "temporary directories are gone"


@pytest.mark.slow
def test_into_and_out_of_the_interleaved_pipeline(chain, tmp_path):
    """R1 (TP1) -> PP2 × VPP2 (one layer per model chunk): resuming with the interleaved schedule
    continues A's curve; its own checkpoint at 6, with the layers spread over chunks and stages,
    reshards back to TP1 exactly (verify) into what the engine writes at TP1 (B's checkpoint)."""
    vpp = tmp_path / "vpp"
    res = cli("reshard", chain["r1"], vpp, "--pipeline", "2", "--virtual-pipeline", "2", "--verify")
    assert res.exit_code == 0 and "verify: OK" in res.output, res.output
    meta = json.loads((vpp / "iter_0000002" / "megacli.json").read_text())
    assert (meta["layout"]["pipeline"], meta["layout"]["virtual_pipeline"]) == (2, 2), meta["layout"]
    resumed = run(tmp_path / "run_d", layout(pp=2) + ["parallel.virtual_pipeline=2", f"checkpoint.resume={vpp}",
                                                          f"checkpoint.dir={tmp_path / 'ck_d'}"])
    assert min(resumed) == 3
    assert_close(resumed, chain["A"], RESUMED, REL)

    back = tmp_path / "back"
    res = cli("reshard", tmp_path / "ck_d" / "iter_0000006", back, "--pipeline", "1", "--virtual-pipeline", "1", "--verify")
    assert res.exit_code == 0 and "verify: OK" in res.output, res.output
    assert entries(back / "iter_0000006") == entries(chain["tmp"] / "ck_b" / "iter_0000006")


@pytest.mark.slow
def test_megatron_lm_legacy_round_trip(chain, tmp_path):
    """megacli torch_dist -> Megatron-LM legacy (torch format) at TP2 × PP2 -> megacli at TP1: weights,
    Adam state, scheduler, RNG and data position come back exactly; megacli.convert's legacy reader
    reads the same weights."""
    import torch

    from megacli.checkpoint.torch_dist import TorchDistReader
    from megacli.checkpoint.megatron_lm.legacy_reader import LegacyCheckpoint

    mlm = tmp_path / "megatron_lm"
    res = cli("reshard", chain["r1"], mlm, "--tensor", "2", "--pipeline", "2", "--format", "legacy")
    assert res.exit_code == 0, res.output
    assert (mlm / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    files = sorted(str(p.relative_to(mlm)) for p in mlm.rglob("model_optim_rng.pt"))
    assert files == [f"iter_0000002/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt" for t in range(2) for p in range(2)]
    last = torch.load(mlm / "iter_0000002" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    assert last["checkpoint_version"] == 3.0 and last["iteration"] == 2
    assert (last["args"].tensor_model_parallel_size, last["args"].pipeline_model_parallel_size) == (2, 2)
    keys = list(last["model"])
    assert keys[0] == "decoder.layers.0.self_attention.linear_proj.weight" and keys[-1] == "output_layer.weight"
    assert last["model"]["decoder.layers.0.mlp.linear_fc2.weight"].shape == (64, 64)  # row-parallel half
    # Extra state as Megatron-LM's local layers write it: None (its loader refuses a pickled `bytes`).
    extra = [v for k, v in last["model"].items() if k.endswith("._extra_state")]
    assert extra and all(v is None for v in extra)
    groups = last["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0] and last["optimizer"]["state"][0]["step"] == 2
    assert last["opt_param_scheduler"]["num_steps"] == 16  # Megatron-LM counts samples

    legacy = LegacyCheckpoint(Source(mlm))
    ours = TorchDistReader(Source(chain["r1"] / "iter_0000002"))
    assert torch.equal(legacy.get("embedding.word_embeddings.weight"), ours.read("embedding.word_embeddings.weight"))
    assert torch.equal(legacy.get("decoder.layers.3.mlp.linear_fc1.weight"), ours.read("decoder.layers.mlp.linear_fc1.weight")[3])

    res = cli("reshard", "inspect", mlm, "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["format"].startswith("megatron-lm legacy") and info["optimizer"] == "standard"
    assert (info["layout"]["tensor"], info["layout"]["pipeline"], info["iteration"]) == (2, 2, 2)

    back = tmp_path / "back"
    res = cli("reshard", mlm, back, "--tensor", "1", "--pipeline", "1", "--verify")
    assert res.exit_code == 0 and "verify: OK" in res.output, res.output
    assert entries(back / "iter_0000002") == entries(chain["r1"] / "iter_0000002")
    res = cli("reshard", "verify", chain["r1"], back)
    assert res.exit_code == 0 and res.stdout.startswith("verify: OK"), res.output
    assert json.loads((back / "iter_0000002" / "megacli.json").read_text())["consumed_samples"] == 16
    assert not list(tmp_path.glob(".megacli-legacy-*")), "the import's staging directory is removed"


_MEMORY_SCRIPT = r"""
import json, sys, threading, time
from pathlib import Path
import psutil, torch, yaml
from megacli.checkpoint.megacli_checkpoint import target_chunks
from megacli.checkpoint.torch_dist import TensorEntry, write_torch_dist

src, recipe_from = Path(sys.argv[1]), Path(sys.argv[2])
L, H = 64, 256
shapes = {"decoder.layers.mlp.linear_fc2.weight": (L, H, H), "decoder.layers.self_attention.linear_proj.weight": (L, H, H),
          "decoder.layers.self_attention.linear_qkv.weight": (L, 3 * H, H)}
shapes.update({f"optimizer.state.{s}.{k}": v for k, v in list(shapes.items()) for s in ("exp_avg", "exp_avg_sq")})
def fill(off, size):
    return torch.full(size, float(off[0]))
write_torch_dist(src, [TensorEntry(k, v, torch.float32, target_chunks(k, v, tp=1, gated=False), fill) for k, v in shapes.items()],
                 [], {"optimizer": {"state": {"common_step": torch.tensor(1.0)}, "param_groups": []}, "scheduler": {}})
recipe = yaml.safe_load(recipe_from.read_text())
recipe["model"].update(num_layers=L, hidden_size=H, ffn_hidden_size=H, num_attention_heads=8, activation="gelu")
recipe["parallel"].update(tensor=1, pipeline=1, sequence_parallel=False, distributed_optimizer=False)
recipe["launch"]["nproc"] = 1
(src / "recipe.yaml").write_text(yaml.safe_dump(recipe))
(src / "megacli.json").write_text(json.dumps({"iteration": 1, "consumed_samples": 8, "format": "torch_dist",
    "layout": {"tensor": 1, "pipeline": 1, "virtual_pipeline": None, "data": 1, "context": 1}}))
largest = max(torch.Size(v).numel() * 4 for v in shapes.values())

from megacli.recipe.reshard import ReshardSection
from megacli.reshard import reshard
proc = psutil.Process()
base = proc.memory_info().rss
peak, stop = [base], []
def sample():
    while not stop:
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.001)
thread = threading.Thread(target=sample)
thread.start()
result = reshard(ReshardSection(source=str(src), output=str(src.parent / "out"), tensor=4, pipeline=2, verify=True))
stop.append(1)
thread.join()
print(json.dumps({"growth": peak[0] - base, "largest": largest, "total": sum(torch.Size(v).numel() * 4 for v in shapes.values()),
                  "ok": result.verified.ok}))
"""


@pytest.mark.slow
def test_reshard_streams_chunks(chain, tmp_path):
    """Peak memory of reshard + verify of a 240 MiB checkpoint (stacked tensors up to 48 MiB, 0.75 MiB
    per layer and rank) stays well under its largest tensor."""
    src = tmp_path / "big" / "iter_0000001"
    src.mkdir(parents=True)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # freed chunks go back to the OS, so RSS is live memory
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(src), str(chain["r1"] / "iter_0000002" / "recipe.yaml")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["ok"]
    assert m["growth"] < m["largest"] / 2, f"peak growth {m['growth'] / 2**20:.1f} MiB vs largest tensor {m['largest'] / 2**20:.0f} MiB"
