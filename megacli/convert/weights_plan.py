"""A converted model's weights as a checkpoint Plan (megacli.checkpoint.writer), read lazily.

The recipe's model is built once at TP=1, PP=1 in a single gloo process, never filled, only for its
sharded state dict: its keys, global shapes, dtypes and the pieces each entry is saved in (one per
stacked layer, per expert, per half of a SwiGLU fc1). Each piece comes from one canonical tensor
(``fetch(canonical key)``: global, any float dtype), fetched when the writer first needs it and
dropped once every box cut from it is written: a conversion holds about one layer at a time.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megacli.checkpoint.megacli_checkpoint import Layout, target_chunks
from megacli.checkpoint.sharding import is_vocab_key
from megacli.checkpoint.torch_dist import ObjectEntry, TensorEntry
from megacli.checkpoint.writer import Plan
from megacli.convert.mapping import fit_vocab_rows
from megacli.convert.megatron_io import megatron_process, shape_mismatch, unstacked_key
from megacli.errors import UserError

_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in a global tensor


@dataclass(frozen=True)
class _Piece:
    """A box of a stored tensor and where it comes from: ``canonical``'s tensor (its ``expert``
    of a stacked expert tensor), fitted and checked against ``want``, cast, then part ``part`` of
    ``parts`` along dim 0 (a factory's pieces), viewed with the stored leading axes."""

    box: Box
    canonical: str
    expert: Optional[int]
    want: tuple[int, ...]
    part: int
    parts: int


def weights_plan(*, recipe, fetch: Callable[[str], torch.Tensor], vocab_size: int, iteration: int,
                 extra_meta: dict, check_keys: Callable[[list[str]], None] | None = None,
                 per_rank_chunks: bool = False) -> Plan:
    """The weights-only megacli checkpoint of ``recipe``'s model whose canonical tensors ``fetch``
    returns (vocabulary rows padded here for the recipe's TP). ``check_keys`` sees every canonical
    key first (to report all missing or unused source tensors at once). ``per_rank_chunks``: store
    each tensor in the boxes the recipe's tensor-parallel ranks hold (as a reshard writes), not in
    the pieces the model saves at TP=1 (as the engine's save in one process)."""
    from megacli.recipe.model import padded_vocab_size

    m = recipe.model
    padded = padded_vocab_size(vocab_size, divisible_by=m.make_vocab_size_divisible_by, tensor_parallel=recipe.parallel.tensor)
    entries, objects = _described(recipe, padded)
    if check_keys:
        check_keys(list(dict.fromkeys(p.canonical for pieces in entries.values() for p in pieces[2])))
    source = _Fetched(fetch, vocab_size)
    tensors = []
    for key, (shape, dtype, pieces) in entries.items():
        boxes = (target_chunks(key, shape, tp=recipe.parallel.tensor, gated=m.gated) if per_rank_chunks
                 else [p.box for p in pieces])
        tensors.append(TensorEntry(key=key, shape=shape, dtype=dtype, chunks=boxes, how="converted",
                                   region=source.region_of(pieces, dtype, boxes)))
    meta = {"iteration": iteration, "consumed_samples": 0, "layout": Layout(tensor=1, pipeline=1).as_meta(),
            "format": "torch_dist", "has_optimizer": False, "has_rng_state": False, **extra_meta}
    return Plan(source=None, target=None, recipe=recipe, tensors=tensors, objects=objects, common={}, meta=meta)


def _described(recipe, padded_vocab: int) -> tuple[dict, list[ObjectEntry]]:
    """The stored tensors of the recipe's model, key -> (global shape, dtype, pieces), and its
    sharded objects (extra state), as saved at TP=PP=1."""
    from megacli.recipe.sections import ParallelSection

    single = recipe.model_copy(update={"parallel": ParallelSection()})
    entries: dict[str, tuple[tuple[int, ...], torch.dtype, list[_Piece]]] = {}
    objects: list[ObjectEntry] = []
    with megatron_process():  # first: it imports Megatron-Core the CPU backend's way (megacli.backend.cpu)
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

        from megacli.engine.models import build_model
        from megacli.engine.models.config import transformer_config

        config = transformer_config(model=recipe.model, parallel=single.parallel, precision=recipe.train.precision,
                                    on_cuda=False, use_cpu_initialization=True, perform_initialization=False)
        state = build_model(recipe=single, config=config, vocab_size=padded_vocab)[0].sharded_state_dict()
        for state_key, sh in state.items():
            if sh is None:
                continue
            if isinstance(sh, ShardedObject):
                objects.append(ObjectEntry(sh.unique_key, _saved_object(sh.data), how="extra state"))
                continue
            canonical = unstacked_key(state_key, sh.key)
            expert = _LOCAL_EXPERT.search(state_key)
            want = tuple(sh.data.shape)
            parts = sh.build() if isinstance(sh, ShardedTensorFactory) else [sh]
            if not isinstance(parts, list) or not all(isinstance(p, ShardedTensor) for p in parts):
                raise UserError(f"internal error: {state_key} builds {type(parts).__name__}, not a list of sharded tensors")
            for i, part in enumerate(parts):
                if part.flattened_range is not None:
                    raise UserError(f"internal error: {state_key} is saved flattened at TP=PP=1")
                box = (tuple(part.global_offset), (1,) * part.prepend_axis_num + tuple(part.local_shape))
                piece = _Piece(box, canonical, int(expert.group(1)) if expert else None, want, i, len(parts))
                entry = entries.setdefault(part.key, (tuple(part.global_shape), part.data.dtype, []))
                entry[2].append(piece)
    return entries, objects


def _saved_object(data) -> Callable[[], bytes]:
    """A sharded object's stored bytes, as Megatron-Core saves them (the list of a rank's objects)."""
    buf = io.BytesIO()
    torch.save([data], buf)
    stored = buf.getvalue()
    return lambda: stored


def _overlap(a: Box, b: Box) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    return None if any(h <= l for l, h in zip(lo, hi)) else (lo, hi)


class _Fetched:
    """The canonical tensors, each fetched once (a source may hand a tensor over only once) and
    kept until every box that needs it is produced."""

    def __init__(self, fetch: Callable[[str], torch.Tensor], vocab_size: int):
        self.fetch, self.vocab_size = fetch, vocab_size
        self.held: dict[str, torch.Tensor] = {}
        self.uses: dict[str, int] = {}

    def region_of(self, pieces: list[_Piece], dtype: torch.dtype, boxes: list[Box]):
        for box in boxes:
            for p in pieces:
                if _overlap(box, p.box):
                    self.uses[p.canonical] = self.uses.get(p.canonical, 0) + 1

        def region(offsets, sizes):
            box = (tuple(offsets), tuple(sizes))
            out = None
            for p in pieces:
                both = _overlap(box, p.box)
                if both is None:
                    continue
                data = self._piece(p, dtype)
                if p.box == box:  # the writer frees what it is given: never the source's memory
                    shared = data.untyped_storage().data_ptr() == self.held[p.canonical].untyped_storage().data_ptr()
                    out = data.clone() if shared else data
                else:
                    if out is None:
                        out = torch.zeros(box[1], dtype=dtype)
                    lo, hi = both
                    out[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, box[0]))] = \
                        data[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, p.box[0]))]
                self._used(p.canonical)
            if out is None:
                raise UserError(f"internal error: no piece of the model covers {list(offsets)}+{list(sizes)}")
            return out

        return region

    def _piece(self, p: _Piece, dtype: torch.dtype) -> torch.Tensor:
        if p.canonical not in self.held:
            self.held[p.canonical] = self.fetch(p.canonical)
        t = self.held[p.canonical]
        if p.expert is not None:  # the layer's experts under one stacked key (built at EP=1: local = global)
            t = t[p.expert]
        if is_vocab_key(p.canonical) and t.dim() == len(p.want) and t.shape[1:] == p.want[1:]:
            t = fit_vocab_rows(t, rows=p.want[0], vocab_size=self.vocab_size, key=p.canonical)
        if tuple(t.shape) != p.want:
            raise shape_mismatch(p.canonical, t.shape, p.want, "the source")
        t = t.to(dtype)
        if p.parts > 1:
            t = t.chunk(p.parts, dim=0)[p.part]
        return t.reshape(p.box[1])

    def _used(self, canonical: str) -> None:
        self.uses[canonical] -= 1
        if self.uses[canonical] == 0:
            self.held.pop(canonical, None)
