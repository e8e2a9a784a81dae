"""A megacli checkpoint's iteration directory as a whole: its torch_dist entries, megacli.json
(iteration, data position, the layout that saved it), recipe.yaml and the names megacli gives
what it saves beside the model (optimizer state, RNG state per rank)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from megacli.checkpoint.layout import RECIPE, read_meta, read_recipe
from megacli.checkpoint.sharding import GATED_SPLIT, rank_pieces, split_of
from megacli.checkpoint.source import Source
from megacli.checkpoint.torch_dist import STACKED, TorchDistReader
from megacli.errors import UserError
from megacli.recipe.stages import chunk_layers, stage_of_layer

OPT_PREFIX = "optimizer.state."
RNG_KEY = re.compile(r"^rng_state/shard_(\d+)\.(\d+)_(\d+)\.(\d+)$")


# ---------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: Optional[int] = None
    data: int = 1
    context: int = 1
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    @classmethod
    def from_meta(cls, d: dict) -> "Layout":
        return cls(tensor=int(d.get("tensor", 1)), pipeline=int(d.get("pipeline", 1)),
                   virtual_pipeline=d.get("virtual_pipeline") or None, data=int(d.get("data", 1)),
                   context=int(d.get("context", 1)), first_stage_layers=d.get("first_stage_layers"),
                   last_stage_layers=d.get("last_stage_layers"))

    def as_meta(self) -> dict:
        meta = {"tensor": self.tensor, "pipeline": self.pipeline, "virtual_pipeline": self.virtual_pipeline,
                "data": self.data, "context": self.context}
        for key, given in (("first_stage_layers", self.first_stage_layers), ("last_stage_layers", self.last_stage_layers)):
            if given is not None:  # as the engine records them: only for uneven stages
                meta[key] = given
        return meta

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.context * self.data

    @property
    def vp(self) -> int:
        return self.virtual_pipeline or 1

    def __str__(self) -> str:
        vp = f" (VP {self.virtual_pipeline})" if self.virtual_pipeline else ""
        cp = f" × CP {self.context}" if self.context > 1 else ""
        uneven = "".join(f", {n} layers on the {which} stage" for which, n in
                         (("first", self.first_stage_layers), ("last", self.last_stage_layers)) if n is not None)
        return f"TP {self.tensor} × PP {self.pipeline}{vp}{cp} × DP {self.data}{uneven}"

    def stage_of_layer(self, layer: int, num_layers: int) -> int:
        """The pipeline rank holding (global, 0-based) ``layer``."""
        return stage_of_layer(layer, num_layers, self.pipeline, self.virtual_pipeline, self.first_stage_layers,
                              self.last_stage_layers)

    def first_layer_of_stage(self, stage: int, num_layers: int) -> int:
        chunks = chunk_layers(num_layers, self.pipeline, self.virtual_pipeline, self.first_stage_layers, self.last_stage_layers)
        return chunks[stage][0].start


# ---------------------------------------------------------------- the checkpoint


class Checkpoint:
    """A megacli torch_dist checkpoint (iteration directory): labels, recipe and entries."""

    def __init__(self, source: Source):
        self.source = source
        self.path = path = source.path
        self.meta = read_meta(path)
        fmt = self.meta.get("format", "torch_dist")
        if fmt != "torch_dist":
            raise UserError(f"{path}: format {fmt!r}; expected torch_dist")
        recipe_file = path / RECIPE
        if not recipe_file.is_file():
            raise UserError(f"{path}: no {RECIPE} (reshard needs the run's recipe to know the model and write the new one)")
        self.recipe_raw = read_recipe(path)
        self.layout = Layout.from_meta(self.meta.get("layout") or {})
        self.reader = TorchDistReader(source)
        self._common: dict | None = None

    @property
    def iteration(self) -> int:
        return int(self.meta.get("iteration", 0))

    @property
    def common(self) -> dict:
        if self._common is None:
            self._common = self.reader.common()
        return self._common

    def section(self, name: str) -> dict:
        return dict(self.recipe_raw.get(name) or {})

    @property
    def model_keys(self) -> list[str]:
        return [k for k in self.reader.tensors if not k.startswith("optimizer.")]

    @property
    def optimizer_kind(self) -> Optional[str]:
        """'distributed' (fully_reshardable), 'standard', or None (no optimizer state)."""
        opt = self.common.get("optimizer")
        if not isinstance(opt, dict):
            return None
        sharding = opt.get("param_state_sharding_type")
        if sharding is not None:
            if sharding != "fully_reshardable":
                raise UserError(f"{self.path}: distributed-optimizer state in the {sharding!r} format; only "
                                f"'fully_reshardable' (what megacli saves) is layout-free and can be resharded")
            return "distributed"
        return "standard"

    @property
    def rng_objects(self) -> dict[tuple[int, int], str]:
        out = {}
        for key in self.reader.objects:
            m = RNG_KEY.match(key)
            if m:
                out[(int(m.group(1)), int(m.group(2)))] = key
        return out


def split_optimizer_key(key: str) -> tuple[Optional[str], str]:
    """``optimizer.state.exp_avg.decoder.x`` -> ('exp_avg', 'decoder.x'); a model key -> (None, key)."""
    if key.startswith(OPT_PREFIX):
        state, _, base = key[len(OPT_PREFIX):].partition(".")
        return state, base
    return None, key


def describe_split(info, num_layers: Optional[int] = None) -> str:
    """How the stored chunks split a tensor, for people: 'per layer · 2 on dim 1', 'whole'."""
    shape = info.shape
    if not shape:
        return "scalar"
    parts = []
    for d in range(len(shape)):
        offsets = sorted({c[0][d] for c in info.chunks})
        if len(offsets) <= 1:
            continue
        sizes = {c[1][d] for c in info.chunks}
        if d == 0 and sizes == {1} and len(offsets) == shape[0] and STACKED.search(split_optimizer_key(info.key)[1]):
            parts.append("per layer")
        else:
            parts.append(f"{len(offsets)} on dim {d}")
    text = " · ".join(parts) if parts else "whole"
    return text


def target_chunks(key: str, shape: tuple[int, ...], *, tp: int, gated: bool) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """How the ranks of a layout with tensor-parallel size ``tp`` hold a global tensor: one chunk
    per transformer layer (stacked keys), split along the tensor-parallel dimension of the weight.
    Any chunking loads under any layout; this one lets each rank read only what it keeps."""
    _, base = split_optimizer_key(key)
    ndim = len(shape)
    if ndim == 0:
        return [((), ())]
    stacked = bool(STACKED.search(base)) and ndim >= 2
    lead = 1 if stacked else 0
    # pieces along each dim: list of (offset, size)
    axes: list[list[tuple[int, int]]] = [[(0, s)] for s in shape]
    if stacked:
        axes[0] = [(i, 1) for i in range(shape[0])]
    split = split_of(base, gated=gated)
    if split is not None:
        tp_dim = lead + (0 if split == GATED_SPLIT else split)
        if tp_dim < ndim:
            axes[tp_dim] = rank_pieces(shape[tp_dim], tp=tp, gated_split=split == GATED_SPLIT)
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
    for pieces in axes:
        chunks = [(o + (po,), s + (ps,)) for o, s in chunks for po, ps in pieces]
    return chunks
