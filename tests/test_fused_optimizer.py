"""optim.fused: torch's fused AdamW kernel under Megatron's optimizer gives the default path's
fp32 losses (CPU backend), and stays on across a checkpoint load."""

from __future__ import annotations

import pytest
import torch

from tests._gpu import TINY_GPT, on_device, pretrain
from tests.conftest import assert_close, steps


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def test_fused_kernel_runs_and_matches_the_default_step(monkeypatch):
    import torch.optim.adam as adam

    from megacli.engine.optim import use_fused_kernels

    calls = []
    fused_adam = adam._fused_adam
    monkeypatch.setattr(adam, "_fused_adam", lambda *a, **k: calls.append(1) or fused_adam(*a, **k))
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    plain_params = [torch.nn.Parameter(p.clone()) for p in start]
    fused_params = [torch.nn.Parameter(p.clone()) for p in start]
    plain, fused = _adamw(plain_params), _adamw(fused_params)
    use_fused_kernels(fused)
    for step_grads in grads:
        for params, opt in ((plain_params, plain), (fused_params, fused)):
            for p, grad in zip(params, step_grads):
                p.grad = grad.clone()
            opt.step()
    assert calls, "the fused kernel ran"
    for a, b in zip(plain_params, fused_params):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)

    fused.load_state_dict(plain.state_dict())  # a checkpoint written without the fused kernel
    assert all(group["fused"] and not group["foreach"] for group in fused.param_groups)
    assert all(fused.state[p]["step"].dtype == torch.float32 for p in fused_params)
    calls.clear()
    fused.step()
    assert calls


@pytest.mark.slow
def test_fused_optimizer_gives_the_default_losses(tmp_path):
    runs = {}
    for name, extra in (("default", []), ("fused", ["optim.fused=true"])):
        pretrain(tmp_path / name, [*TINY_GPT, "train.iters=4", *on_device("cpu", "fp32"), *extra])
        runs[name] = steps(tmp_path / name)
    assert sorted(runs["fused"]) == [1, 2, 3, 4]
    assert_close(runs["fused"], runs["default"], range(1, 5), rel=1e-5)
    assert_close(runs["fused"], runs["default"], range(1, 5), rel=1e-4, key="grad_norm")


def test_fused_kernel_is_the_default_on_cuda_only():
    from megacli.recipe.sections import OptimSection

    default = OptimSection()
    assert default.fused is None and default.fused_on(True) and not default.fused_on(False)
    assert not OptimSection(fused=False).fused_on(True)
    assert OptimSection(fused=True).fused_on(False)
