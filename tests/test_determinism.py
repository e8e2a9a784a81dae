"""train.deterministic on the CPU backend: what tests/test_gpu.py checks on a GPU (two identical
runs log bitwise-identical losses and gradient norms), here in fp32 on gloo with the same helpers,
plus what the option switches on."""

from __future__ import annotations

import pytest
import torch

from tests._gpu import TINY_GPT, assert_bitwise, assert_loss_falls, on_device, pretrain
from tests.conftest import steps


@pytest.mark.slow
def test_two_deterministic_runs_are_bitwise_identical(tmp_path):
    runs = []
    for name in ("first", "second"):
        pretrain(tmp_path / name, [*TINY_GPT, "train.iters=6", *on_device("cpu", "fp32", deterministic=True)],
                 in_process=True)  # each run in its own fresh process, with no separate worker to start
        runs.append(steps(tmp_path / name))
    assert sorted(runs[0]) == list(range(1, 7))
    assert_loss_falls(runs[0], by=0.3)
    assert_bitwise(runs[1], runs[0])


def test_deterministic_kernels_are_switched_on():
    from megacli.engine.distributed import use_deterministic_kernels

    before = torch.are_deterministic_algorithms_enabled()
    try:
        use_deterministic_kernels("cpu")
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_the_comparisons_fail_on_a_difference():
    from tests.conftest import assert_close

    a = {1: {"loss": 5.0, "grad_norm": 1.0}, 2: {"loss": 4.0, "grad_norm": 0.5}}
    b = {1: {"loss": 5.0, "grad_norm": 1.0}, 2: {"loss": 4.0 + 4e-16 * 4, "grad_norm": 0.5}}
    assert_bitwise(a, dict(a))
    with pytest.raises(AssertionError, match="step 2 loss"):
        assert_bitwise(b, a)
    assert_close(b, a, [1, 2], rel=1e-12)
    with pytest.raises(AssertionError):
        assert_loss_falls(a, by=1.5)
