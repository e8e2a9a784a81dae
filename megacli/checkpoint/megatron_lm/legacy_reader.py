"""Megatron-LM legacy (``--ckpt-format torch``) checkpoints, read into canonical global tensors.

Layout (megatron/training/checkpointing.py):

    CKPT/latest_checkpointed_iteration.txt     "1000" (or "release")
    CKPT/iter_0001000/mp_rank_TT/model_optim_rng.pt          pipeline size 1
    CKPT/iter_0001000/mp_rank_TT_PPP/model_optim_rng.pt      pipeline size > 1

Each file is a torch.save'd dict: ``args`` (the argparse Namespace of the run),
``checkpoint_version`` (3.0), ``iteration``, ``model`` (``model0``, ``model1``, ... with virtual
pipeline stages), ``optimizer``, ``opt_param_scheduler``, ``rng_state``. Model keys are either
Megatron-Core's (``decoder.layers.N.self_attention.linear_qkv.weight``, with the norm keys of the
Transformer-Engine or the local spec) or the legacy model's nested ``language_model`` dicts
(``encoder.layers.N.self_attention.query_key_value.weight``); N counts layers within the chunk.

GPT and BERT (pretrain_bert.py) checkpoints are read; BERT is told apart by its masked-LM head
(``lm_head.*``) and its layers become ``encoder.layers.N`` (Megatron-Core's BertModel names). T5
checkpoints (a decoder with cross-attention) are refused.

Tensor-parallel shards are merged as tools/checkpoint/loader_core.py does: column-parallel
weights along dim 0 (SwiGLU's [gate; up] halves per rank), row-parallel along dim 1, the rest
taken from rank 0; with ``optimizer=True`` the standard optimizer's Adam state comes along, merged
the same way. Files are unpickled with megacli.checkpoint.safe_pickle's allow-list.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch

from megacli.checkpoint import sharding
from megacli.checkpoint.layout import iteration_dir, rank_files
from megacli.checkpoint.megatron_lm.keys import FUSED_INTO, fused_prefix
from megacli.checkpoint.megatron_lm.args_to_recipe import ArgsDescribed
from megacli.checkpoint.megatron_lm.args import arg, model_section_from_args
from megacli.checkpoint.safe_pickle import torch_load
from megacli.checkpoint.source import Source
from megacli.errors import UserError
from megacli.recipe.stages import chunk_layers, split_problem, stage_of_layer

# Legacy-model (megatron/legacy/model) and local-spec names -> canonical (TE-style) names.
_RENAMES = [
    (r"language_model\.embedding\.(word|position|tokentype)_embeddings\.", r"embedding.\1_embeddings."),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(?:input_norm|input_layernorm)\.(weight|bias)",
     r"decoder.layers.\1.self_attention.linear_qkv.layer_norm_\2"),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.self_attention\.query_key_value\.",
     r"decoder.layers.\1.self_attention.linear_qkv."),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.self_attention\.dense\.", r"decoder.layers.\1.self_attention.linear_proj."),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(?:post_attention_norm|post_attention_layernorm)\.(weight|bias)",
     r"decoder.layers.\1.mlp.linear_fc1.layer_norm_\2"),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.mlp\.dense_h_to_4h\.", r"decoder.layers.\1.mlp.linear_fc1."),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.mlp\.dense_4h_to_h\.", r"decoder.layers.\1.mlp.linear_fc2."),
    (r"language_model\.(?:encoder|transformer)\.(?:final_norm|final_layernorm)\.", r"decoder.final_layernorm."),
    (r"language_model\.output_layer\.", r"output_layer."),
    *((rf"(decoder|encoder)\.layers\.(\d+)\.{norm}\.(weight|bias)", rf"\1.layers.\2.{fused_prefix(norm)}\3")
      for norm in FUSED_INTO),
    # BERT: the legacy model's pooler and masked-LM head (its vocabulary bias, its norm named norm or layernorm).
    (r"language_model\.pooler\.", r"pooler."),
    (r"lm_head\.bias\Z", r"output_layer.bias"),
    (r"lm_head\.(?:norm|layernorm)\.", r"lm_head.layer_norm."),
]
_RENAMES = [(re.compile(a), b) for a, b in _RENAMES]
# Not weights: TE/fp8 extra state, RoPE frequency buffers (neither a parameter), the last stage's
# copy of a tied embedding (a parameter, with optimizer state).
_NOT_PARAMETER = re.compile(r"(_extra_state$|inv_freq$)")
_SKIP = re.compile(r"(_extra_state$|inv_freq$|^word_embeddings_for_head\.)")

LAYER = re.compile(r"^(?:decoder|encoder)\.layers\.(\d+)\.(.*)$")
_CROSS_ATTENTION = re.compile(r"(inter_attention|cross_attention|language_model\.decoder\.)")


# ---------------------------------------------------------------- key names


def flatten(state: dict, prefix: str = "") -> dict:
    """Nested legacy-model state dicts -> dotted keys (Megatron-Core state dicts are flat already)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def canonical_name(key: str) -> str | None:
    """Canonical (TE-style) name of a legacy or local-spec key; None for entries that are not weights."""
    if _SKIP.search(key):
        return None
    for pat, repl in _RENAMES:
        if pat.match(key):
            return pat.sub(repl, key, count=1)
    return key


class LegacyCheckpoint(ArgsDescribed):
    """A Megatron-LM legacy checkpoint as canonical global tensors (and, with ``optimizer``, their
    optimizer state), one pipeline stage's files (all its tensor-parallel ranks, memory-mapped)
    open at a time."""

    def __init__(self, source: Source, *, optimizer: bool = False):
        self.source = source
        self.root = source.path
        self.it_dir = iteration_dir(self.root)
        self.files = rank_files(self.it_dir)
        self.tp = 1 + max(t for t, _ in self.files)
        self.pp = 1 + max(p for _, p in self.files)
        self.first = first = self.read(self.files[(0, 0)])
        version = first.get("checkpoint_version", 0)
        if version < 3.0:
            raise UserError(f"{self.files[(0, 0)]}: checkpoint_version {version}; only version 3.0 (any Megatron-LM since "
                            f"2021) is supported")
        self.args = first.get("args")
        if self.args is None:
            raise UserError(f"{self.files[(0, 0)]} has no 'args' (needed to know the model)")
        self.iteration = int(first.get("iteration", 0) or 0)
        saved_tp, saved_pp = arg(self.args, "tensor_model_parallel_size", 1), arg(self.args, "pipeline_model_parallel_size", 1)
        if (saved_tp, saved_pp) != (self.tp, self.pp):
            raise UserError(f"{self.it_dir}: args say TP={saved_tp} PP={saved_pp} but the directory holds TP={self.tp} "
                            f"PP={self.pp} rank files")
        self.vp = len([k for k in first if re.fullmatch(r"model\d+", k)]) or 1
        self.num_layers = self.args.num_layers
        # Uneven pipeline stages: Megatron-LM's --decoder-first/last-pipeline-num-layers.
        self.first_stage_layers = arg(self.args, "decoder_first_pipeline_num_layers") or None
        self.last_stage_layers = arg(self.args, "decoder_last_pipeline_num_layers") or None
        split = (self.num_layers, self.pp, self.vp if self.vp > 1 else None, self.first_stage_layers, self.last_stage_layers)
        problem = split_problem(*split, hint=False)
        if problem:
            raise UserError(f"{self.it_dir}: args split num_layers = {self.num_layers} over PP {self.pp} × VPP {self.vp} "
                            f"in a way Megatron-Core does not: {problem[0]} = {problem[1]} {problem[2]}")
        self.split = split
        self.arch = self._arch(first)
        self.untied = bool(arg(self.args, "untie_embeddings_and_output_weights", False))
        self.swiglu = bool(arg(self.args, "swiglu", False))
        opt = first.get("optimizer")
        inner = opt.get("optimizer", opt) if isinstance(opt, dict) else None
        # An empty optimizer state (a run saved before its first step, or a weights-only export) = weights only.
        self.has_optimizer = isinstance(inner, dict) and bool(inner.get("state"))
        self.read_optimizer = optimizer and self.has_optimizer
        self._stage: tuple[int, dict] | None = None

    def read(self, f: Path) -> dict:
        """One rank file (allow-listed unpickling unless the checkpoint is trusted)."""
        return torch_load(f, trust=self.source.trust, name=f, mmap=True)

    def _arch(self, first: dict) -> str:
        """gpt or bert, from the first and last stage's keys: BERT has a masked-LM head (lm_head.*)
        on its last stage; T5 (refused) has a decoder with cross-attention beside an encoder."""
        last = first if self.pp == 1 else self.read(self.files[(0, self.pp - 1)])
        keys = [k for state in (first, last) for name in state if name == "model" or re.fullmatch(r"model\d+", name)
                for k in flatten(state[name])]
        stacks = {k.split(".", 1)[0] for k in keys if re.match(r"(encoder|decoder)\.layers\.", k)}
        if any(_CROSS_ATTENTION.search(k) for k in keys) or stacks == {"encoder", "decoder"}:
            raise UserError(f"{self.it_dir}: an encoder-decoder (T5) checkpoint; Megatron-LM legacy T5 checkpoints are "
                            f"not supported (GPT and BERT are)")
        return "bert" if any(k.startswith("lm_head.") for k in keys) else "gpt"

    @property
    def _stack(self) -> str:
        """The canonical name of the layer stack: Megatron-Core's BertModel calls it encoder."""
        return "encoder" if self.arch == "bert" else "decoder"

    # --- what the model is

    def padded_vocab_rows(self) -> int:
        emb = self._weights(0).get("embedding.word_embeddings.weight")
        if emb is None:
            raise UserError(f"{self.files[(0, 0)]}: no word embeddings in the first pipeline stage")
        return sum(t.shape[0] for t in emb)

    def model_section(self) -> dict:
        if arg(self.args, "num_experts"):
            raise UserError(f"{self.it_dir}: legacy (--ckpt-format torch) MoE checkpoints (num_experts) are not "
                            f"supported (Megatron-LM torch_dist ones are)")
        return model_section_from_args(self.args, self.vocab_size(), arch=self.arch)

    def dtype(self) -> torch.dtype:
        emb = self._weights(0).get("embedding.word_embeddings.weight")
        return emb[0].dtype if emb else torch.float32

    # --- tensors

    def chunk_offset(self, pp_rank: int, vp_rank: int) -> int:
        return chunk_layers(*self.split)[pp_rank][vp_rank].start

    def stage_of(self, name: str) -> int:
        """The pipeline stage holding canonical key ``name``."""
        m = LAYER.match(name)
        if m:
            return stage_of_layer(int(m.group(1)), *self.split)
        return 0 if name.startswith("embedding.") else self.pp - 1

    def stage(self, pp_rank: int) -> dict:
        """Canonical key (global layer numbers) -> {"weight": [TP shards]} for one pipeline stage;
        when the optimizer state is read (``optimizer=True`` and the files hold it) also each Adam
        state ("exp_avg", "exp_avg_sq", "fp32_param": [TP shards]), plus "_step" and "_groups" (the
        optimizer's step and param groups). The last stage read stays open until ``forget_stage()``."""
        optimizer = self.read_optimizer
        if self._stage is not None and self._stage[0] == pp_rank:
            return self._stage[1]
        self._stage = None
        out: dict = {}
        steps: set = set()
        groups = None
        for tp_rank in range(self.tp):
            f = self.files[(tp_rank, pp_rank)]
            state = self.first if (tp_rank, pp_rank) == (0, 0) else self.read(f)
            chunks = [state["model"]] if "model" in state else [state[f"model{v}"] for v in range(self.vp)]
            params: list[tuple[str | None, str, torch.Tensor]] = []  # (canonical or None, local name, tensor)
            for vp_rank, chunk in enumerate(chunks):
                offset = self.chunk_offset(pp_rank, vp_rank)
                for key, tensor in flatten(chunk).items():
                    if not isinstance(tensor, torch.Tensor) or _NOT_PARAMETER.search(key):
                        continue
                    name = self._global_name(canonical_name(key), offset)
                    params.append((name, key, tensor))
                    if name is not None:
                        out.setdefault(name, {}).setdefault("weight", []).append(tensor)
            if optimizer:
                g, s = optimizer_state(f, state.get("optimizer"), params, out)
                groups = groups or g
                steps |= s
        for name, kinds in out.items():
            for kind, shards in kinds.items():
                if len(shards) != self.tp:
                    raise UserError(f"{self.it_dir}: {name} ({kind}) is in {len(shards)} of the {self.tp} tensor-parallel "
                                    f"files of stage {pp_rank}")
        if optimizer:
            if len(steps) > 1:
                raise UserError(f"{self.it_dir}: the optimizer step differs between parameters ({sorted(steps)})")
            out["_step"] = steps.pop() if steps else None
            out["_groups"] = groups
        self._stage = (pp_rank, out)
        return out

    def forget_stage(self) -> None:
        """Close the stage ``stage()`` keeps (its memory-mapped files)."""
        self._stage = None

    def _global_name(self, name: str | None, offset: int) -> str | None:
        """A chunk's canonical key with the global layer number; None for what is not a weight of
        its own (the last stage's copy of a tied embedding)."""
        if name is None:
            return None
        if name.startswith("decoder.") and self.arch == "bert":  # the legacy model's encoder
            name = "encoder." + name[len("decoder."):]
        m = LAYER.match(name)
        if m:
            name = f"{self._stack}.layers.{int(m.group(1)) + offset}.{m.group(2)}"
        if name == "output_layer.weight" and not self.untied:
            return None
        return name

    def _weights(self, pp_rank: int) -> dict[str, list[torch.Tensor]]:
        return {name: kinds["weight"] for name, kinds in self.stage(pp_rank).items() if not name.startswith("_")}

    def _merge(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return sharding.merge(name, parts, gated=self.swiglu)

    def groups(self, meta: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Global tensors by canonical key, merged one group at a time: per pipeline stage its
        non-layer tensors, then each of its layers. ``meta``: shapes and dtypes only."""
        found_layers = 0
        for pp_rank in range(self.pp):
            stage = self._weights(pp_rank)
            by_layer: dict[int | None, list[str]] = {}
            for name in stage:
                m = LAYER.match(name)
                by_layer.setdefault(int(m.group(1)) if m else None, []).append(name)
            found_layers += len([k for k in by_layer if k is not None])
            order = [None] + sorted(k for k in by_layer if k is not None) if None in by_layer else sorted(by_layer)
            for layer in order:
                yield {name: self._merge(name, [p.to("meta") for p in stage[name]] if meta else stage[name])
                       for name in by_layer[layer]}
        self.forget_stage()
        if found_layers != self.num_layers:
            raise UserError(f"{self.it_dir}: found {found_layers} transformer layers, args say num_layers = {self.num_layers}")

    def canonical_keys(self) -> list[str]:
        """Every canonical key in the checkpoint, stage by stage (opens each stage's files, memory-mapped)."""
        names: list[str] = []
        for pp_rank in range(self.pp):
            names += list(self._weights(pp_rank))
        self.forget_stage()
        return names

    def get(self, name: str, kind: str = "weight") -> torch.Tensor:
        """One global tensor (``kind``: the weight or an optimizer state of it)."""
        p = self.stage_of(name)
        kinds = self.stage(p).get(name)
        if kinds is None or kind not in kinds:
            raise UserError(f"{self.it_dir}: no {kind} of {name} in pipeline stage {p} (the args and the weights disagree?)")
        return self._merge(name, kinds[kind])


# ---------------------------------------------------------------- optimizer state


def _no_wd(name: str, t: torch.Tensor) -> bool:
    """Megatron-Core's default: no weight decay for biases and 1-D parameters."""
    return name.endswith(".bias") or t.dim() == 1


def optimizer_state(f: Path, opt, params, out) -> tuple[list, set]:
    """Add one rank file's Adam state to ``out`` (canonical key -> {state: [TP shards]}), matching
    the standard optimizer's positional indices to ``params`` (canonical name or None, local key,
    tensor; in file order), and return its param groups and the steps it holds.

    Its state dict indexes parameters by position, group by group, each group's parameters in the
    model's ``named_parameters()`` order - the order of the saved model state dict. Megatron-Core
    puts weights in one group and biases and 1-D parameters (norms, no weight decay) in another;
    each group is matched by its ``wd_mult``."""
    if not isinstance(opt, dict):
        raise UserError(f"{f}: no optimizer state")
    if "param_state" in opt or "param_state_sharding_type" in opt:
        raise UserError(f"{f}: distributed-optimizer state is not supported in legacy checkpoints")
    if "fp32_from_fp16_params" in opt or "fp32_from_fp16" in opt:
        inner = opt["optimizer"]
        fp32 = opt.get("fp32_from_fp16_params", opt.get("fp32_from_fp16"))
    else:
        inner, fp32 = opt, None
    if "state" not in inner or "param_groups" not in inner:
        raise UserError(f"{f}: unrecognised optimizer state (keys {sorted(inner)})")
    classes = {True: [p for p in params if _no_wd(p[1], p[2])], False: [p for p in params if not _no_wd(p[1], p[2])]}
    used = {True: 0, False: 0}
    steps: set = set()
    for gi, group in enumerate(inner["param_groups"]):
        if group.get("is_expert_parallel") or float(group.get("lr_mult", 1.0)) != 1.0:
            raise UserError(f"{f}: optimizer param group {gi} uses expert parallelism or an lr_mult; not supported")
        no_wd = float(group.get("wd_mult", 1.0)) == 0.0
        members = classes[no_wd][used[no_wd]:used[no_wd] + len(group["params"])]
        used[no_wd] += len(group["params"])
        if len(members) != len(group["params"]):
            raise UserError(f"{f}: optimizer param group {gi} has {len(group['params'])} parameters, the model "
                            f"{'biases/norms' if no_wd else 'weights'} left are {len(members)}")
        for j, (idx, (name, local, t)) in enumerate(zip(group["params"], members)):
            st = inner["state"].get(idx, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st and tuple(st[k].shape) != tuple(t.shape):
                    raise UserError(f"{f}: optimizer state {idx} ({k} {tuple(st[k].shape)}) does not match parameter "
                                    f"{local} {tuple(t.shape)}: the parameter order is not Megatron-Core's")
            if "step" in st:
                steps.add(float(st["step"]))
            if name is None:
                continue
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    out[name].setdefault(k, []).append(st[k])
            if fp32 is not None:
                out[name].setdefault("fp32_param", []).append(fp32[gi][j])
    for no_wd, members in classes.items():
        if used[no_wd] != len(members):
            raise UserError(f"{f}: {len(members) - used[no_wd]} model parameters have no optimizer state")
    groups = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in inner["param_groups"]]
    return groups, steps
