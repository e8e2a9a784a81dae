"""Between layout-free global tensors and Megatron's sharded (torch_dist) checkpoints.

A torch_dist checkpoint stores every tensor in its global (unsharded) shape, whatever layout wrote
it, and loads under any TP/PP/DP. So reading needs no model: the checkpoint's own metadata gives
keys, global shapes and dtypes, and Megatron's loader reads one layer at a time. Writing is
convert.weights_plan's (the model's sharded state dict as a checkpoint Plan).

Canonical keys are the ShardedTensor keys of ``GPTModel.sharded_state_dict()`` with the global
layer number put back after ``layers.`` (there, layers are stacked along a leading axis). A MoE
layer's experts stay stacked along their own leading axis under one key per layer
(``decoder.layers.3.mlp.experts.experts.linear_fc1.weight``: [experts, ...]).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Callable, Iterator

import torch

from megacli.checkpoint.sharding import is_vocab_key
from megacli.checkpoint.source import Source
from megacli.checkpoint.torch_dist import NOT_MODEL, STACKED, TorchDistReader
from megacli.errors import UserError

_LAYER_IN_STATE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@contextlib.contextmanager
def megatron_process():
    """torch.distributed (one gloo process, in-memory store) and Megatron's parallel state at
    TP=PP=1, for the duration of a conversion. Without CUDA this enables the CPU backend for the
    rest of the process (see megacli.backend.cpu)."""
    from megacli.engine.distributed import quiet_megatron_imports

    quiet_megatron_imports()
    import torch.distributed as dist

    if not torch.cuda.is_available():
        from megacli.backend import cpu

        cpu.enable()  # Megatron-Core calls CUDA while building a model; on a CPU-only build those are no-ops
    from megatron.core import parallel_state as ps
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        if owns_group:
            dist.destroy_process_group()


def unstacked_key(state_key: str, sharded_key: str) -> str:
    """``decoder.layers.3.input_layernorm.weight`` (state dict) with sharded key
    ``decoder.layers.self_attention.linear_qkv.layer_norm_weight`` ->
    ``decoder.layers.3.self_attention.linear_qkv.layer_norm_weight``."""
    m = _LAYER_IN_STATE_KEY.search(state_key)
    if m is None or not STACKED.search(sharded_key):
        return sharded_key
    head, tail = STACKED.split(sharded_key, maxsplit=1)
    sep = "." if head else ""
    return f"{head}{sep}layers.{m.group(1)}.{tail}"


def shape_mismatch(key: str, got: tuple, want: tuple, source: str) -> UserError:
    """A shape error that says which tensor, both shapes, and the likely cause."""
    got, want = tuple(got), tuple(want)
    cause = "the source config and its weights disagree, or the model section does not describe these weights"
    if len(got) == len(want):
        diff = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        if len(diff) == 1:
            g, w = got[diff[0]], want[diff[0]]
            if is_vocab_key(key) and diff[0] == 0:
                cause = "wrong vocabulary size or padding (model.vocab_size / make_vocab_size_divisible_by × TP)"
            elif w % g == 0:
                cause = (f"the source holds 1/{w // g} of dimension {diff[0]}: a tensor-parallel shard "
                         f"(a TP={w // g} checkpoint read as TP=1?)")
    return UserError(f"shape mismatch for {key}: {source} has {list(got)}, the model expects {list(want)} ({cause})")


class CheckpointReader:
    """The model weights of a megacli (torch_dist) checkpoint as global tensors under canonical
    keys, without building a model, one layer at a time. ``rename(stored key, all stored keys)``
    gives another writer's key its canonical name (None: not a weight)."""

    def __init__(self, source: Source, *, rename: Callable[[str, set[str]], str | None] | None = None):
        self.ckpt = ckpt = source.path
        self.reader = TorchDistReader(source)
        self.all_tensors = {k: (info.shape, info.dtype) for k, info in self.reader.tensors.items()}
        self.stored = {k: v for k, v in self.all_tensors.items() if k.split(".")[0] not in NOT_MODEL}
        self.stored_as: dict[str, str] = {}  # canonical -> stored key, when renamed
        if rename is not None:
            names, renamed = set(self.stored), {}
            for key, value in self.stored.items():
                name = rename(key, names)
                if name is not None:
                    renamed[name] = value
                    self.stored_as[name] = key
            self.stored = renamed
        # Layers per stack ("decoder"; T5 also has "encoder"): the leading axis of its stacked tensors.
        self.stacks: dict[str, int] = {}
        for key, (shape, _) in self.stored.items():
            if STACKED.search(key):
                head = STACKED.split(key, maxsplit=1)[0]
                if self.stacks.setdefault(head, shape[0]) != shape[0]:
                    raise UserError(f"{ckpt}: layer-stacked tensors of {head or 'the model'} disagree on the number of "
                                    f"layers ({self.stacks[head]} vs {shape[0]} in {key})")

    def _canonical(self, key: str, layer: int) -> str:
        head, tail = STACKED.split(key, maxsplit=1)
        return f"{head}{'.' if head else ''}layers.{layer}.{tail}"

    def describe(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Canonical key -> (global shape, dtype), without reading data."""
        out = {}
        for key, (shape, dtype) in self.stored.items():
            if STACKED.search(key):
                for i in range(shape[0]):
                    out[self._canonical(key, i)] = (shape[1:], dtype)
            else:
                out[key] = (shape, dtype)
        return out

    def canonical_keys(self) -> list[str]:
        return list(self.describe())

    def dtype(self) -> torch.dtype:
        return next((d for _, d in self.stored.values() if d.is_floating_point), torch.float32)

    def groups(self, meta: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Global tensors by canonical key: the embeddings first, then each layer, then the final
        norm and output layer. ``meta``: shapes and dtypes only (meta tensors, nothing read)."""
        plain = {k: v for k, v in self.stored.items() if not STACKED.search(k)}
        first = {k: v for k, v in plain.items() if not k.startswith(("output_layer", "decoder.final"))}
        last = {k: v for k, v in plain.items() if k not in first}
        yield self._load({k: (k, None) for k in first}, meta)
        for head, layers in self.stacks.items():
            stacked = [k for k in self.stored if STACKED.search(k) and STACKED.split(k, maxsplit=1)[0] == head]
            for i in range(layers):
                yield self._load({self._canonical(k, i): (k, i) for k in stacked}, meta)
        if last:
            yield self._load({k: (k, None) for k in last}, meta)

    def _load(self, wanted: dict[str, tuple[str, int | None]], meta: bool) -> dict[str, torch.Tensor]:
        out = {}
        for name, (key, layer) in wanted.items():
            shape, dtype = self.stored[key]
            if meta:
                out[name] = torch.empty(shape[1 if layer is not None else 0:], dtype=dtype, device="meta")
            elif layer is None:
                out[name] = self.reader.read(self.stored_as.get(key, key))
            else:
                out[name] = self.reader.read_region(self.stored_as.get(key, key), (layer,) + (0,) * (len(shape) - 1), (1, *shape[1:]))[0]
        return out


class MergedLoRA:
    """A LoRA run's checkpoint read as full weights (the interface of CheckpointReader): its base
    checkpoint's tensors, each adapted weight replaced by W + (alpha / rank)·B·A."""

    def __init__(self, source: Source, *, base: Path, scale: float):
        ckpt = source.path
        self.base = CheckpointReader(source.at(base))
        self.adapters, self.scale = CheckpointReader(source), scale
        for key in self.adapters.canonical_keys():
            if not key.endswith(("lora_a", "lora_b")):
                raise UserError(f"{ckpt}: a LoRA checkpoint holds adapters only, not {key}")
            weight = key.rsplit(".", 1)[0] + ".weight"
            if weight not in self.base.describe():
                raise UserError(f"{ckpt}: adapter {key} has no base weight {weight} in {base}")

    def canonical_keys(self) -> list[str]:
        return self.base.canonical_keys()

    def dtype(self) -> torch.dtype:
        return self.base.dtype()

    def groups(self, meta: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        from megacli.engine.models.lora import merged

        adapters = {} if meta else {k: v for group in self.adapters.groups() for k, v in group.items()}
        for group in self.base.groups(meta=meta):
            for key in group:
                stem = key[: -len("weight")]
                if stem + "lora_a" in adapters:
                    group[key] = merged(group[key], adapters.pop(stem + "lora_a"), adapters.pop(stem + "lora_b"), self.scale)
            yield group


class MegatronLMWeights:
    """A Megatron-LM torch_dist checkpoint (megacli.checkpoint.megatron_lm.dist_reader) with its weights read
    as the converters read a legacy checkpoint's: canonical keys, one layer at a time."""

    def __init__(self, source: Source):
        from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint, canonical_key

        self.src = MegatronLMCheckpoint(source)
        self.weights = CheckpointReader(source.at(self.src.it_dir), rename=canonical_key)
        self._loaded: dict[str, torch.Tensor] | None = None

    def __getattr__(self, name):  # args, iteration, layout, model section, tokenizer: the checkpoint's
        return getattr(self.src, name)

    def canonical_keys(self) -> list[str]:
        return self.weights.canonical_keys()

    def dtype(self) -> torch.dtype:
        return self.weights.dtype()

    def groups(self, meta: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        return self.weights.groups(meta=meta)

    def get(self, key: str) -> torch.Tensor:
        """One global tensor by canonical key, handed over once (all are read on the first call)."""
        if self._loaded is None:
            self._loaded = {k: t for group in self.groups() for k, t in group.items()}
        if key not in self._loaded:
            raise UserError(f"{self.src.it_dir}: no weight {key}")
        return self._loaded.pop(key)
