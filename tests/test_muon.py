"""optim.optimizer: muon, through Megatron-Core 0.19's own Muon (over NVIDIA's emerging-optimizers).

At TP1 its updates equal the published reference implementation (Keller Jordan's Muon, written out
below, with the Moonlight update scale 0.2·sqrt(max(rows, cols)) megacli chooses) on the same
gradients, with AdamW (torch's) on embeddings, norms and biases; TP2 × PP2 gives TP1's losses; a
resume continues exactly; Megatron-Core's distributed (layer-wise) Muon gives the plain optimizer's
losses, across a resume too. Under Megatron-Core 0.16.1 the recipe is refused, naming the field and
the versions it needs."""

from __future__ import annotations

import math

import pytest

from megacli.engine.core_compat import MUON_SINCE, core_since
from tests._dist import spawn
from tests.conftest import MOCK_GPT, assert_close, layout, losses, pretrain

needs_muon = pytest.mark.skipif(not core_since(MUON_SINCE), reason=f"Megatron-Core < {MUON_SINCE} has no Muon")
MUON = [*MOCK_GPT, "optim.optimizer=muon", "optim.lr=2e-2"]
REL = 1e-4  # another layout: another order of floating-point sums
LR, WD, MOMENTUM, ADAM_BETAS, STEPS = 2e-2, 0.1, 0.95, (0.9, 0.95), 3


def newton_schulz5(g, steps: int = 5, eps: float = 1e-7):
    """Keller Jordan's zeropower_via_newtonschulz5 (github.com/KellerJordan/Muon), in fp32."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = g.T if g.size(0) > g.size(1) else g
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


def reference_muon(weight, grads: list):
    """The reference Muon steps of one matrix: decoupled weight decay, Nesterov momentum, the
    orthogonalized update scaled to AdamW's RMS (Moonlight)."""
    import torch

    w, buf = weight.clone(), torch.zeros_like(weight)
    for g in grads:
        w.mul_(1 - LR * WD)
        buf.lerp_(g, 1 - MOMENTUM)
        update = newton_schulz5(g.lerp(buf, MOMENTUM))
        w.add_(update * 0.2 * math.sqrt(max(w.shape)), alpha=-LR)
    return w


def reference_adamw(weight, grads: list, weight_decay: float):
    import torch

    p = torch.nn.Parameter(weight.clone())
    opt = torch.optim.AdamW([p], lr=LR, betas=ADAM_BETAS, eps=1e-8, weight_decay=weight_decay)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _w_muon_steps(rank, world_size):
    """A tiny GPT (tied and position embeddings, LayerNorm, biases) under megacli's muon optimizer:
    STEPS steps on given random gradients; its weights before and after, and the gradients."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megacli.engine.optim import build_optimizer, build_scheduler
    from megacli.recipe.sections import OptimSection
    from tests.test_backend import _build, _config, _init_by_name, _np, _setup

    _setup(1, 1)
    config = _config(1, 1)
    model = _build(config)
    _init_by_name(model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optim = OptimSection(optimizer="muon", lr=LR, min_lr=LR, weight_decay=WD, clip_grad=0.0, decay_style="constant",
                         adam_beta1=ADAM_BETAS[0], adam_beta2=ADAM_BETAS[1], muon_momentum=MOMENTUM)
    opt = build_optimizer([ddp], optim=optim, precision="fp32", distributed_optimizer=False, on_cuda=False)
    build_scheduler(opt, optim=optim, train_iters=10)
    start = {n: _np(p) for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(7)
    grads = []
    for _ in range(STEPS):
        ddp.zero_grad_buffer()
        step = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.main_grad.copy_(step[n])
        ok, _, _ = opt.step()
        assert ok
        grads.append({n: _np(g) for n, g in step.items()})
    qkv = [config.kv_channels * config.num_attention_heads // config.num_query_groups, config.kv_channels, config.kv_channels]
    return {"start": start, "grads": grads, "after": {n: _np(p) for n, p in model.named_parameters()},
            "groups": config.num_query_groups, "qkv": qkv}


def _reference(name: str, start, grads: list, groups: int, qkv: list):
    """The reference weights of one parameter after the steps: Muon on the hidden 2-D weights
    (Q, K and V apart), AdamW on the rest, no weight decay on norms and biases."""
    import torch

    if start.dim() != 2 or "embedding" in name:
        return reference_adamw(start, grads, WD if start.dim() == 2 else 0.0)
    if "linear_qkv" not in name:
        return reference_muon(start, grads)

    def pieces(t):  # [groups * (q + k + v), hidden] -> the Q, K and V matrices
        return [p.reshape(-1, t.size(1)) for p in torch.split(t.view(groups, sum(qkv), -1), qkv, dim=1)]

    per_piece = zip(pieces(start), *[pieces(g) for g in grads])
    done = [reference_muon(w, list(gs)).view(groups, -1, start.size(1)) for w, *gs in per_piece]
    return torch.cat(done, dim=1).view_as(start)


@needs_muon
def test_tp1_updates_equal_the_reference_implementation():
    import torch

    got = spawn(_w_muon_steps, 1)[0]
    muon_names = [n for n, t in got["start"].items() if t.ndim == 2 and "embedding" not in n]
    assert any("linear_qkv" in n for n in muon_names) and any("linear_fc2" in n for n in muon_names)
    for name, start in got["start"].items():
        grads = [torch.from_numpy(step[name]) for step in got["grads"]]
        want = _reference(name, torch.from_numpy(start), grads, got["groups"], got["qkv"])
        torch.testing.assert_close(torch.from_numpy(got["after"][name]), want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    run = tmp_path_factory.mktemp("muon") / "tp1"
    pretrain(run, [*MUON, *layout()])
    return losses(run)


@needs_muon
@pytest.mark.slow
def test_tp2_pp2_matches_tp1(tp1, tmp_path):
    assert tp1[6] < tp1[1] - 0.3, tp1
    pretrain(tmp_path / "tp2pp2", [*MUON, *layout(tp=2, pp=2, sp=True)])
    assert_close(losses(tmp_path / "tp2pp2"), tp1, range(1, 7), REL)


@needs_muon
@pytest.mark.slow
def test_resume_is_exact(tp1, tmp_path):
    """Stopped after step 3 and resumed, steps 4-6 are the uninterrupted run's."""
    ck = tmp_path / "ck"
    pretrain(tmp_path / "run", [*MUON, *layout(), f"checkpoint.dir={ck}", "train.exit_after_iters=3"])
    pretrain(tmp_path / "run", [*MUON, *layout(), f"checkpoint.dir={ck}"])
    resumed = losses(tmp_path / "run")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert_close(resumed, tp1, range(1, 7), 1e-6)


@needs_muon
@pytest.mark.slow
def test_the_distributed_optimizer_equals_the_plain_one(tmp_path):
    """DP2 in bf16 (what the layer-wise optimizer needs): each rank updates whole matrices, then
    gathers the others' (on the CPU backend an all-gather of unequal sizes, which it pads), and the
    losses are the plain optimizer's, across a stop after step 3 and a resume too."""
    bf16 = [*MUON, "train.precision=bf16"]
    pretrain(tmp_path / "plain", [*bf16, *layout(dp=2)])
    dist_opt = [*bf16, *layout(dp=2, dist_opt=True), f"checkpoint.dir={tmp_path / 'ck'}"]
    pretrain(tmp_path / "dist", [*dist_opt, "train.exit_after_iters=3"])
    pretrain(tmp_path / "dist", dist_opt)
    plain, dist = losses(tmp_path / "plain"), losses(tmp_path / "dist")
    assert sorted(dist) == [1, 2, 3, 4, 5, 6] and plain[6] < plain[1] - 0.3, plain
    assert_close(dist, plain, range(1, 7), REL)


@pytest.mark.skipif(core_since(MUON_SINCE), reason="this Megatron-Core has Muon")
def test_refused_without_megatron_core_0_19(tmp_path):
    from tests.conftest import megacli, sets_args

    out = megacli("pretrain", *sets_args([*MUON, f"run.dir={tmp_path / 'run'}"]))
    assert out.returncode == 2, out.stderr
    message = out.stderr + out.stdout
    assert "optim.optimizer" in message and "Megatron-Core 0.19" in message and "Python 3.12" in message
    assert "Traceback" not in message and not (tmp_path / "run").exists()
