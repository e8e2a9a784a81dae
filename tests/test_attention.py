"""CoreAttention (megacli/engine/models/attention.py): against Megatron-Core's DotProductAttention, ALiBi
against an explicit softmax, and ring context parallelism (spawned gloo processes) against CP=1.

All fp32 on CPU; outputs and input gradients must agree within 1e-5 absolute."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

from tests._dist import spawn

TOL = dict(atol=1e-5, rtol=0)


class _Group:
    """Stands in for a process group: CoreAttention only asks its size() and rank()."""

    def __init__(self, size: int = 1, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _pgs(tp: _Group | None = None, cp=None) -> SimpleNamespace:
    return SimpleNamespace(tp=tp or _Group(), cp=cp or _Group())


def _config(heads: int, groups: int, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=4, hidden_size=16 * heads, num_attention_heads=heads, num_query_groups=groups,
                  kv_channels=16, attention_dropout=0.0)
    return TransformerConfig(**(fields | overrides))


def _core(config, mask_type, pgs=None, layer_number=1, **kwargs):
    from megacli.engine.models.attention import CoreAttention

    return CoreAttention(config, layer_number, mask_type, "self", pg_collection=pgs or _pgs(), **kwargs)


def _qkv(s, b, heads, groups, hn=16):
    shapes = ((s, b, heads, hn), (s, b, groups, hn), (s, b, groups, hn))
    return [torch.randn(shape, requires_grad=True) for shape in shapes]


def _padding_mask(s, lengths):
    """Megatron's padding mask [b, 1, s, s], True = masked, for sequences of the given lengths:
    padded keys are masked for every query, and padded queries see nothing."""
    valid = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
    return ~(valid[:, None, :, None] & valid[:, None, None, :])


def _run(module, q, k, v, mask, grad):
    """Output and q/k/v gradients of ``module`` for upstream gradient ``grad``."""
    for t in (q, k, v):
        t.grad = None
    out = module(q, k, v, mask)
    out.backward(grad)
    return out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()


def _assert_all_close(got, want, what):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, name=name: f"{what} {name}: {m}")


# ---------------------------------------------------------------------------------------------
# Against Megatron-Core's DotProductAttention


@pytest.fixture
def megatron_dpa(monkeypatch):
    """Builds Megatron-Core's DotProductAttention runnable on CPU: its scratch buffer and its RNG
    fork are CUDA-only, so both are replaced for the test (dropout is 0)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    buffer = SimpleNamespace(get_tensor=lambda shape, dtype, name: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: buffer)
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker",
                        lambda *a, **k: SimpleNamespace(fork=contextlib.nullcontext))

    def build(config, mask_type, layer_number=1, softmax_scale=None):
        return DotProductAttention(config, layer_number, mask_type, "self", softmax_scale=softmax_scale,
                                   pg_collection=_pgs())

    return build


@pytest.mark.parametrize("heads,groups,overrides,layer_number,softmax_scale", [
    (8, 8, {}, 1, None),
    (8, 2, {}, 1, None),  # grouped-query attention
    (4, 4, {"apply_query_key_layer_scaling": True}, 3, None),
    (4, 1, {}, 2, 0.3),  # multi-query attention, explicit softmax scale
])
def test_causal_matches_megatron(megatron_dpa, heads, groups, overrides, layer_number, softmax_scale):
    from megatron.core.transformer.enums import AttnMaskType

    torch.manual_seed(0)
    s, b = 16, 2
    config = _config(heads, groups, **overrides)
    q, k, v = _qkv(s, b, heads, groups)
    grad = torch.randn(s, b, heads * 16)
    ours = _core(config, AttnMaskType.causal, layer_number=layer_number, softmax_scale=softmax_scale)
    theirs = megatron_dpa(config, AttnMaskType.causal, layer_number, softmax_scale)
    causal_mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]  # theirs builds it on CUDA
    _assert_all_close(_run(ours, q, k, v, None, grad), _run(theirs, q, k, v, causal_mask, grad), "causal")


@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2)])
def test_padding_matches_megatron(megatron_dpa, heads, groups):
    from megatron.core.transformer.enums import AttnMaskType

    torch.manual_seed(1)
    s, b, lengths = 12, 3, [12, 7, 3]
    config = _config(heads, groups)
    q, k, v = _qkv(s, b, heads, groups)
    mask = _padding_mask(s, lengths)
    valid = (torch.arange(s)[:, None] < torch.tensor(lengths)[None, :])[..., None]  # [s, b, 1] query rows
    grad = torch.randn(s, b, heads * 16) * valid  # a loss mask: padded positions carry no gradient
    ours = _run(_core(config, AttnMaskType.padding), q, k, v, mask, grad)
    theirs = _run(megatron_dpa(config, AttnMaskType.padding), q, k, v, mask, grad)
    # Megatron averages all values on a query row with nothing to attend to; we give zeros there.
    assert torch.equal(ours[0] * ~valid, torch.zeros_like(ours[0]))
    _assert_all_close((ours[0] * valid, *ours[1:]), (theirs[0] * valid, *theirs[1:]), "padding")


def test_module_spec_params_reach_init():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megacli.engine.models.attention import CoreAttention

    spec = ModuleSpec(module=CoreAttention, params={"position_bias": "alibi"})
    # the keyword arguments SelfAttention passes to its core_attention submodule
    module = build_module(spec, config=_config(4, 4), layer_number=1, attn_mask_type=AttnMaskType.causal,
                          attention_type="self", cp_comm_type=None, softmax_scale=None, pg_collection=_pgs())
    assert isinstance(module, CoreAttention) and module.position_bias == "alibi"
    with pytest.raises(NotImplementedError, match="packed"):
        q, k, v = _qkv(4, 1, 4, 4)
        module(q, k, v, None, packed_seq_params=object())


# ---------------------------------------------------------------------------------------------
# ALiBi


def _paper_slopes(n):
    """The ALiBi authors' reference code (ofirpress/attention_with_linear_biases)."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _paper_slopes(2 * closest)[0::2][: n - closest]


def test_alibi_slopes():
    from megacli.engine.models.alibi import alibi_slopes

    assert alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    for n in (1, 2, 3, 5, 6, 12, 16, 20, 40, 96):
        assert alibi_slopes(n) == pytest.approx(_paper_slopes(n), rel=1e-12), n


def _explicit_alibi(q, k, v, slopes, scale, mask, symmetric):
    """softmax(QK^T * scale + slope * (j - i)) V, or -slope * |j - i| when ``symmetric``;
    ``mask`` [b|1, 1, s, s] True = masked. Layout [s, b, h, d] in, [s, b, h*d] out."""
    s = q.size(0)
    heads = q.size(2)
    k, v = (t.repeat_interleave(heads // t.size(2), dim=2) for t in (k, v))
    scores = torch.einsum("ibhd,jbhd->bhij", q, k) * scale
    distance = torch.arange(s)[None, :] - torch.arange(s)[:, None]  # j - i
    distance = -distance.abs() if symmetric else distance
    scores = scores + torch.tensor(slopes)[:, None, None] * distance
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.einsum("bhij,jbhd->ibhd", probs, v).reshape(s, q.size(1), -1)


@pytest.mark.parametrize("heads,groups,tp", [
    (12, 12, _Group(1, 0)), (12, 4, _Group(2, 1)), (6, 3, _Group(3, 2)),
])
def test_alibi_causal_matches_explicit(heads, groups, tp):
    """Tensor-parallel rank r holds global heads r*np ... (r+1)*np - 1, with those heads' slopes."""
    from megatron.core.transformer.enums import AttnMaskType

    from megacli.engine.models.alibi import alibi_slopes

    torch.manual_seed(2)
    s, b = 16, 2
    local_heads, local_groups = heads // tp.size(), groups // tp.size()
    module = _core(_config(heads, groups), AttnMaskType.causal, _pgs(tp=tp), position_bias="alibi")
    first = tp.rank() * local_heads
    assert module.alibi_slopes == alibi_slopes(heads)[first : first + local_heads]

    q, k, v = _qkv(s, b, local_heads, local_groups)
    grad = torch.randn(s, b, local_heads * 16)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    ref = lambda q, k, v, mask: _explicit_alibi(q, k, v, module.alibi_slopes, 0.25, causal, symmetric=False)
    _assert_all_close(_run(module, q, k, v, None, grad), _run(ref, q, k, v, None, grad), "alibi causal")


def test_alibi_bidirectional_is_symmetric():
    from megatron.core.transformer.enums import AttnMaskType

    torch.manual_seed(3)
    s, b, heads, groups = 12, 2, 4, 2
    module = _core(_config(heads, groups), AttnMaskType.padding, position_bias="alibi")
    q, k, v = _qkv(s, b, heads, groups)
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    mask[1, ..., 9:] = True  # padded keys of the second sequence
    grad = torch.randn(s, b, heads * 16)
    ref = lambda q, k, v, mask: _explicit_alibi(q, k, v, module.alibi_slopes, 0.25, mask, symmetric=True)
    _assert_all_close(_run(module, q, k, v, mask, grad), _run(ref, q, k, v, mask, grad), "alibi padding")


# ---------------------------------------------------------------------------------------------
# Ring context parallelism: CP=2 and CP=4 against CP=1 on the same batch

SEQ, BATCH = 32, 2
CP_CASES = {  # name: (mask type, heads, query groups, ALiBi, padding lengths or None[, sliding window])
    "causal_gqa": ("causal", 8, 2, False, None),
    # a window (6) shorter than a CP=4 chunk (4 tokens) and than a CP=2 chunk (8): whole blocks masked
    "window_gqa_padding": ("padding_causal", 8, 2, False, [32, 19], 5),
    "causal_alibi": ("causal", 6, 3, True, None),
    "padding_causal_mqa": ("padding_causal", 4, 1, False, [32, 19]),
    "padding_alibi": ("padding", 4, 4, True, [23, 5]),  # bidirectional; fully masked query rows
}


def _cp_case(group, rank, mask_type, heads, groups, alibi, lengths, window=None):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.utils import get_batch_on_this_cp_rank

    torch.manual_seed(4)  # the same full batch on every rank
    q, k, v = _qkv(SEQ, BATCH, heads, groups)
    grad = torch.randn(SEQ, BATCH, heads * 16)
    mask = None if lengths is None else _padding_mask(SEQ, lengths)
    config = _config(heads, groups, context_parallel_size=1, window_size=None if window is None else (window, 0))
    kwargs = dict(position_bias="alibi" if alibi else "none")
    mask_type = AttnMaskType[mask_type]
    reference = _run(_core(config, mask_type, **kwargs), q, k, v, mask, grad) if rank == 0 else None

    # Megatron's own split: [b, s, ...] tensors, the mask cut along its query dimension.
    seq_first = dict(q=q, k=k, v=v, grad=grad, pos=torch.arange(SEQ)[:, None])
    batch = {name: t.detach().transpose(0, 1).contiguous() for name, t in seq_first.items()}
    batch = get_batch_on_this_cp_rank(batch | {"attention_mask": mask}, cp_group=group)
    local = {name: t.transpose(0, 1) for name, t in batch.items() if name != "attention_mask"}
    ql, kl, vl = (local[name].clone().requires_grad_() for name in "qkv")
    ring = _core(config, mask_type, _pgs(cp=group), **kwargs)
    result = _run(ring, ql, kl, vl, batch["attention_mask"], local["grad"])
    # numpy, not tensors: tensors cross the result queue in shared memory owned by this process
    as_numpy = lambda tensors: None if tensors is None else [t.numpy() for t in tensors]
    return dict(positions=local["pos"][:, 0].numpy(), result=as_numpy(result), reference=as_numpy(reference))


def _ring_directional_derivative(group, rank, dropout_p):
    """d/de of the total loss along a random direction of every rank's q/k/v: the ring backward
    (which must redraw the forward's dropout masks) against a central difference, in fp64."""
    import torch.distributed as dist

    from megacli.engine.models.ring_attention import ring_attention

    torch.manual_seed(10 + rank)
    q = torch.randn(1, 2, 2, 8, 4, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 1, 8, 4, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(q.shape, dtype=torch.float64)
    directions = [torch.randn_like(t) for t in (q, k, v)]
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(2, 2, 1, 1)

    def loss(q, k, v):
        torch.manual_seed(99 + rank)  # the same dropout masks on every evaluation
        out = ring_attention(q, k, v, group, causal=True, scale=0.5, slopes=slopes, dropout_p=dropout_p)
        return (out * grad).sum()

    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*inputs).backward()
    analytic = sum((t.grad * d).sum() for t, d in zip(inputs, directions))
    eps = 1e-6
    with torch.no_grad():
        plus = loss(*(t + eps * d for t, d in zip((q, k, v), directions)))
        minus = loss(*(t - eps * d for t, d in zip((q, k, v), directions)))
    both = torch.stack((analytic, (plus - minus) / (2 * eps)))
    dist.all_reduce(both, group=group)
    return both.tolist()


def _cp_worker(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    results = {name: _cp_case(group, rank, *case) for name, case in CP_CASES.items()}
    results["directional"] = [_ring_directional_derivative(group, rank, p) for p in (0.0, 0.3)]
    return results


def _gather(parts: list[dict], index: int) -> torch.Tensor:
    """Put each rank's local tensor back at its global sequence positions."""
    positions = sorted(p for part in parts for p in part["positions"].tolist())
    assert positions == list(range(SEQ))
    full = torch.empty((SEQ,) + parts[0]["result"][index].shape[1:])
    for part in parts:
        full[torch.from_numpy(part["positions"])] = torch.from_numpy(part["result"][index])
    return full


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_cp1(cp):
    results = spawn(_cp_worker, cp)
    for name in CP_CASES:
        parts = [ranks[name] for ranks in results]
        gathered = [_gather(parts, i) for i in range(4)]
        reference = [torch.from_numpy(t) for t in results[0][name]["reference"]]
        _assert_all_close(gathered, reference, f"CP={cp} {name}")
    for dropout_p, (analytic, numeric) in zip((0.0, 0.3), results[0]["directional"]):
        assert analytic == pytest.approx(numeric, rel=1e-7, abs=1e-9), f"CP={cp} dropout={dropout_p}"


# ---------------------------------------------------------------------------------------------
# Inside Megatron: a GPT layer from Megatron's local spec with CoreAttention, CP=2 via parallel_state


def _layer_worker(rank, world_size):
    from megacli.backend import cpu

    cpu.enable()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megacli.engine.models.attention import CoreAttention

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    model_parallel_cuda_manual_seed(123)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=CoreAttention, params={"position_bias": "alibi"})
    config = _config(4, 2, num_layers=1, hidden_size=32, kv_channels=8, attention_dropout=0.2,
                     hidden_dropout=0.0, context_parallel_size=world_size, use_cpu_initialization=True)
    torch.manual_seed(5)  # the same weights and batch on every rank
    layer = build_module(spec, config=config, layer_number=1).eval()
    core = layer.self_attention.core_attention
    x, grad = torch.randn(SEQ, BATCH, 32), torch.randn(SEQ, BATCH, 32)

    def run(x, grad):
        layer.zero_grad()
        x = x.clone().requires_grad_()
        out, _ = layer(x, attention_mask=None)
        out.backward(grad)
        return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}

    assert core.cp_group is not None and core.cp_group.size() == world_size
    core.cp_group, ring_group = None, core.cp_group  # CP=1: the whole sequence through SDPA
    ref_out, ref_dx, ref_params = run(x, grad)
    core.cp_group = ring_group
    batch = {name: t.transpose(0, 1).contiguous() for name, t in
             dict(x=x, grad=grad, pos=torch.arange(SEQ)[:, None]).items()}
    local = {name: t.transpose(0, 1) for name, t in get_batch_on_this_cp_rank(batch).items()}
    out, dx, params = run(local["x"], local["grad"])
    for p in params.values():  # what data-parallel-with-CP gradient reduction sums
        dist.all_reduce(p, group=ring_group)
    positions = local["pos"][:, 0]
    checks = dict(out=(out, ref_out[positions]), dx=(dx, ref_dx[positions]))
    checks |= {f"grad {n}": (params[n], ref_params[n]) for n in params}

    # Attention dropout under CP draws from Megatron's RNG tracker; the ring backward must replay it.
    core.train()
    q = torch.randn(SEQ // world_size, BATCH, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(SEQ // world_size, BATCH, 2, 8, dtype=torch.float64) for _ in range(2))
    upstream = torch.randn(SEQ // world_size, BATCH, 32, dtype=torch.float64)
    directions = [torch.randn_like(t) for t in (q, k, v)]

    def loss(q, k, v):
        model_parallel_cuda_manual_seed(7)
        return (core(q, k, v, None) * upstream).sum()

    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*inputs).backward()
    analytic = sum((t.grad * d).sum() for t, d in zip(inputs, directions))
    with torch.no_grad():
        plus = loss(*(t + 1e-6 * d for t, d in zip((q, k, v), directions)))
        minus = loss(*(t - 1e-6 * d for t, d in zip((q, k, v), directions)))
        plain = core.eval()(q, k, v, None)
        model_parallel_cuda_manual_seed(7)
        dropped = not torch.equal(plain, core.train()(q, k, v, None))
    directional = torch.stack((analytic, (plus - minus) / 2e-6))
    dist.all_reduce(directional)
    return dict(checks={n: (a.numpy(), b.numpy()) for n, (a, b) in checks.items()},
                directional=directional.tolist(), dropped=dropped)


@pytest.mark.slow
def test_ring_attention_in_megatron_gpt_layer():
    pytest.importorskip("megacli.backend.cpu")
    for rank, result in enumerate(spawn(_layer_worker, 2)):
        for name, (got, want) in result["checks"].items():
            torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), **TOL,
                                       msg=lambda m, name=name: f"rank {rank} {name}: {m}")
        analytic, numeric = result["directional"]
        assert analytic == pytest.approx(numeric, rel=1e-7, abs=1e-9)
        assert result["dropped"]
