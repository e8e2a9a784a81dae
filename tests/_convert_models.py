"""Test helpers for `megacli convert`: tiny random Hugging Face models built from config dicts (no
downloads), logits of a megacli checkpoint computed through the engine under any TP/PP, and a
writer of Megatron-LM legacy checkpoints (the layout megatron/training/checkpointing.py saves).

Everything heavy is imported inside functions: these run in spawned processes.
"""

from __future__ import annotations

import argparse
import io
import zlib
from pathlib import Path

from megacli.checkpoint.layout import iter_name
from megacli.checkpoint.source import Source

VOCAB = 300  # not a multiple of 128: padding differs at TP=1 (384) and TP=2 (512)

COMMON_LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5)

# name -> (transformers config class, kwargs)
MODELS = {
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, layer_norm_epsilon=1e-5,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "llama_tied_gqa": ("LlamaConfig", dict(COMMON_LLAMA, tie_word_embeddings=True)),
    "llama_untied_gqa": ("LlamaConfig", dict(COMMON_LLAMA, tie_word_embeddings=False, head_dim=16)),
    "mistral": ("MistralConfig", dict(COMMON_LLAMA, tie_word_embeddings=False, sliding_window=4096)),
    "qwen2": ("Qwen2Config", dict(COMMON_LLAMA, tie_word_embeddings=False)),
}
# Mixture of experts: 4 experts, top 2; Qwen2-MoE with a gated shared expert, QKV biases and its
# second layer dense (mlp_only_layers).
MOE_MODELS = {
    "mixtral": ("MixtralConfig", dict(COMMON_LLAMA, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                      tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(COMMON_LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=40, mlp_only_layers=[1], tie_word_embeddings=False)),
}
# RoPE scaling: Llama-3.2-1B's rope_scaling block verbatim, the same with a short original context
# (so the low, smooth and high frequency bands all occur within the test's 128 positions), linear and yarn.
LLAMA_LONG = dict(COMMON_LLAMA, max_position_embeddings=256, tie_word_embeddings=False, head_dim=16)
ROPE_MODELS = {
    "llama3_2": ("LlamaConfig", dict(LLAMA_LONG, rope_theta=500000.0, rope_scaling={
        "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"})),
    "llama3_short": ("LlamaConfig", dict(LLAMA_LONG, rope_scaling={
        "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64,
        "rope_type": "llama3"})),
    "linear": ("LlamaConfig", dict(LLAMA_LONG, rope_scaling={"factor": 4.0, "rope_type": "linear"})),
    "yarn": ("LlamaConfig", dict(LLAMA_LONG, tie_word_embeddings=False, rope_scaling={
        "factor": 4.0, "original_max_position_embeddings": 64, "rope_type": "yarn"})),
}
# Qwen3: per-head q/k RMSNorm, head_dim (16) != hidden / heads (8).
QWEN3_MODELS = {"qwen3": ("Qwen3Config", dict(COMMON_LLAMA, head_dim=16, tie_word_embeddings=False))}
# Issue #19's families, each with its released configs' features on and an odd layer count (an
# uneven split at PP=2). Qwen3-MoE (Qwen3-30B-A3B-like): per-head q/k norm, head_dim 16 != 32 / 4,
# renormalised top-k, a dense layer (mlp_only_layers) between MoE ones. OLMo 2: output norms,
# q/k norm over whole projections, GQA. Phi-4-mini: fused qkv and gate_up, partial RoPE (0.75 of
# head_dim 16), tied embeddings.
FAMILY_MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON_LLAMA, num_hidden_layers=3, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1],
                                         tie_word_embeddings=False)),
    "olmo2": ("Olmo2Config", dict(COMMON_LLAMA, num_hidden_layers=3, tie_word_embeddings=False, pad_token_id=0,
                                  eos_token_id=1)),
    "phi4_mini": ("Phi3Config", dict(COMMON_LLAMA, hidden_size=64, num_hidden_layers=3, partial_rotary_factor=0.75,
                                     tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}
# Layers that do not split evenly over PP=2 (uneven pipeline stages).
ODD_LAYER_MODELS = {"llama_3_layers": ("LlamaConfig", dict(COMMON_LLAMA, num_hidden_layers=3, tie_word_embeddings=False))}
# Sliding windows (5) shorter than the 16-token test sequences; Qwen2 windows its layers from
# max_window_layers = 1 on. Gemma 2: alternating local/global layers, small soft-caps (so they bind),
# query_pre_attn_scalar != head_dim. Gemma 3: local, local, global layers, q/k norms, a local RoPE
# base, linear RoPE scaling on the global layers. Three layers: uneven PP=2 stages.
_WINDOW_COMMON = dict(COMMON_LLAMA, num_hidden_layers=3, tie_word_embeddings=False)
_GEMMA_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=5,
                     query_pre_attn_scalar=12, pad_token_id=0, bos_token_id=0, eos_token_id=0)
WINDOW_MODELS = {
    "mistral_window": ("MistralConfig", dict(_WINDOW_COMMON, sliding_window=5)),
    # Megatron-LM's --window-size with --use-rope-scaling (Llama 3.1's scaling, which Megatron-Core hard-codes)
    "mistral_window_llama3_1": ("MistralConfig", dict(_WINDOW_COMMON, sliding_window=5, head_dim=16, max_position_embeddings=16384, rope_scaling={
        "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"})),
    "qwen2_window": ("Qwen2Config", dict(_WINDOW_COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "phi3_window": ("Phi3Config", dict(FAMILY_MODELS["phi4_mini"][1], sliding_window=5)),
    "gemma2": ("Gemma2Config", dict(_GEMMA_COMMON, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "gemma3": ("Gemma3TextConfig", dict(_GEMMA_COMMON, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1000000.0}})),
}
# DeepSeek (multi-latent attention + MoE with a shared expert after one dense layer, yarn RoPE).
# V3: compressed queries (q_lora_rank), sigmoid scores with a (random) expert bias, 4 groups of 2
# experts of which 2 are picked, top 4, scaled by 2.5; yarn's mscale != mscale_all_dim, so both the
# cos/sin factor and the softmax-scale factor differ from 1. V2-Lite style: queries projected
# directly, softmax over all experts, greedy top 2, two shared experts, yarn with mscale = mscale_all_dim.
DEEPSEEK_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12,
                       qk_nope_head_dim=8, first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-6,
                       tie_word_embeddings=False)
DEEPSEEK_MODELS = {
    "deepseek_v3": ("DeepseekV3Config", dict(
        DEEPSEEK_COMMON, q_lora_rank=24, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, n_group=4,
        topk_group=2, num_experts_per_tok=4, norm_topk_prob=True, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0})),
    "deepseek_v2_lite": ("DeepseekV2Config", dict(
        DEEPSEEK_COMMON, q_lora_rank=None, n_shared_experts=2, n_routed_experts=6, routed_scaling_factor=1.0,
        num_experts_per_tok=2, topk_method="greedy", n_group=1, topk_group=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0})),
}
ARCHITECTURES = {"Qwen3MoeConfig": "Qwen3MoeForCausalLM", "Olmo2Config": "Olmo2ForCausalLM", "Phi3Config": "Phi3ForCausalLM",
                 "Gemma2Config": "Gemma2ForCausalLM", "Gemma3TextConfig": "Gemma3ForCausalLM", "DeepseekV3Config": "DeepseekV3ForCausalLM", "DeepseekV2Config": "DeepseekV2ForCausalLM", "Qwen3Config": "Qwen3ForCausalLM", "MixtralConfig": "MixtralForCausalLM", "Qwen2MoeConfig": "Qwen2MoeForCausalLM", "GPT2Config": "GPT2LMHeadModel", "LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM",
                 "Qwen2Config": "Qwen2ForCausalLM"}


def tokens(seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 16), generator=g)


def save_tokenizer(path: Path) -> None:
    """A small byte-level BPE tokenizer (trained on a few sentences) saved as an HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>").save_pretrained(path)


def build_hf(name: str, path: Path, *, with_tokenizer: bool = False):
    """Save a tiny random HF model (every parameter random, biases and norm gains included, so each
    mapping rule matters). Returns the model (eval mode, fp32, eager attention)."""
    import torch
    import transformers

    cls_name, kwargs = {**MODELS, **MOE_MODELS, **ROPE_MODELS, **QWEN3_MODELS, **ODD_LAYER_MODELS, **WINDOW_MODELS, **DEEPSEEK_MODELS, **FAMILY_MODELS}[name]
    config = getattr(transformers, cls_name)(**kwargs, architectures=[ARCHITECTURES[cls_name]])
    config._attn_implementation = "eager"
    torch.manual_seed(zlib.crc32(name.encode()) % 1000)  # the same weights in every process
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or ".ln_" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p)) if pname.endswith("weight") else p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.1)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias
                b.normal_(0, 0.1)
    model.eval()
    model.save_pretrained(path)
    if with_tokenizer:
        save_tokenizer(path)
    return model


def round_trip(d: Path, *, parallel, say=lambda *_: None) -> dict:
    """d/hf (an HF model) -> d/mc (megacli, prepared for ``parallel``) -> d/hf2: whether the tensors
    come back bitwise under the same names, and both config.json files."""
    import json

    import torch
    from safetensors.torch import load_file

    from megacli.convert import convert

    convert(Source(d / "hf"), d / "mc", parallel=parallel, say=say)
    convert(Source(d / "mc"), d / "hf2", say=say)
    a, b = load_file(d / "hf" / "model.safetensors"), load_file(d / "hf2" / "model.safetensors")
    return {"same_keys": sorted(a) == sorted(b), "bitwise": all(torch.equal(a[k], b[k]) for k in a if k in b),
            "config": [json.loads((d / x / "config.json").read_text()) for x in ("hf", "hf2")]}


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


def hf_logits(model, toks):
    import torch

    with torch.no_grad():
        return model(toks).logits.float()


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    return model.eval()


# ---------------------------------------------------------------- megacli generate and serve


def one_process_generate_recipe(ckpt: Path, **generate):
    """The GenerateRecipe of a converted checkpoint (its iter_0000000's recipe) for one CPU process,
    with these ``generate:`` fields."""
    from megacli.recipe import base
    from megacli.recipe.generate import GenerateRecipe

    raw = base.read_yaml(ckpt / "iter_0000000" / "recipe.yaml")
    raw["launch"].update(nproc=1, device="cpu")
    raw["train"]["global_batch_size"] = raw["train"]["micro_batch_size"]
    return base.validate(GenerateRecipe, {**raw, "generate": {"checkpoint": str(ckpt), **generate}}, "test")


def served_greedy(ckpt: Path, runtime, prompts: list[list[int]], new: int) -> dict:
    """Greedy tokens of equally long ``prompts`` decoded through megacli serve's cache (``Slots``)
    as its batcher runs them: each prompt joins two steps after the one before and leaves after
    ``new`` tokens, and the cache holds one prompt and its answer, so its columns move left before
    the last is done. The tokens and the number of moves."""
    from megacli.inference.runner import Model
    from megacli.inference.serve.slots import Slots, check_servable

    recipe = one_process_generate_recipe(ckpt)
    model = Model(recipe, runtime, vocab_size=recipe.model.vocab_size)
    check_servable(model)
    slots = Slots(model, max_batch=len(prompts), capacity=len(prompts[0]) + new)
    tokens: dict[int, list[int]] = {}

    def step():
        running = [s for s in tokens if slots.start[s] is not None]
        logits = slots.step({s: tokens[s][-1] for s in running})
        for s in running:
            tokens[s].append(int(logits[s].argmax()))
            if len(tokens[s]) == new:
                slots.release(s)

    for s, ids in enumerate(prompts):
        tokens[s] = [int(slots.admit([s], [ids])[0].argmax())]
        for _ in range(2 if s < len(prompts) - 1 else 0):
            step()
    while any(start is not None for start in slots.start):
        step()
    return {"tokens": [tokens[s] for s in range(len(prompts))], "shifts": slots.shifts}


# ---------------------------------------------------------------- megacli logits


def megacli_logits(ckpt_dir: Path, toks, overrides: tuple[str, ...] = ()):
    """Logits [b, s, vocab] of a megacli checkpoint under the current Megatron parallel state
    (built and loaded through the engine, forward through Megatron's forward-only schedule,
    vocab-parallel logits gathered over TP, padding trimmed). None except on the last pipeline
    stage's first TP rank. ``overrides``: more recipe --set items (sequence or expert parallelism)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megacli.engine import checkpoint
    from megacli.engine.models import build_model
    from megacli.engine.models.config import transformer_config
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ckpt = checkpoint.find_checkpoint(ckpt_dir)
    one_stage = ("parallel.first_stage_layers=null", "parallel.last_stage_layers=null") if pp == 1 else ()
    sets = [f"parallel.tensor={tp}", f"parallel.pipeline={pp}", "parallel.virtual_pipeline=null", *one_stage,
            "parallel.sequence_parallel=false", f"launch.nproc={tp * pp}", "train.global_batch_size=8", *overrides]
    if ckpt is None:  # a Megatron-LM torch_dist checkpoint: the recipe its args map to
        from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint
        from megacli.recipe.base import apply_overrides, validate

        src = MegatronLMCheckpoint(Source(Path(ckpt_dir)))
        ckpt, recipe = src.it_dir, validate(TrainingRecipe, apply_overrides(src.recipe(), sets), str(ckpt_dir))
    else:
        recipe = load(TrainingRecipe, ckpt / "recipe.yaml", sets)
    config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="fp32", on_cuda=False)
    chunks = build_model(recipe=recipe, config=config, vocab_size=recipe.model.vocab_size)
    checkpoint.load(source=Source(ckpt), chunks=chunks, optimizer=None, scheduler=None, load_optimizer=False)
    for c in chunks:
        c.eval()
    b, s = toks.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)

    def forward_step(data_iterator, model):
        out = model(next(data_iterator), positions, None)

        def collect(output):
            full = gather_from_tensor_model_parallel_region(output)
            return output.sum() * 0, torch.tensor(1), {"logits": full.detach()}

        return out, collect

    with torch.no_grad():
        reports = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([toks]), model=chunks[0],
                                              num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    if not ps.is_pipeline_last_stage() or ps.get_tensor_model_parallel_rank() != 0:
        return None
    return reports[0]["logits"][..., : recipe.model.vocab_size].float()


# ---------------------------------------------------------------- Megatron-LM legacy checkpoints


class NotAllowListed:
    """Stands for arbitrary pickled code in a checkpoint (the --trust-pickle test)."""

    def __init__(self, value=1):
        self.value = value


def _canonical_from_hf(hf_dir: Path, *, padded_rows: int) -> tuple[dict, object]:
    """Global Megatron tensors (canonical keys) of an HF model, via its family's mapping table."""
    import re

    from megacli.checkpoint.sharding import is_vocab_key
    from megacli.convert import families, hf_io
    from megacli.convert.mapping import fit_vocab_rows
    from megacli.recipe.model import ModelSection

    config = hf_io.read_json(hf_dir / "config.json")
    family, _ = families.for_hf_config(config)
    model = ModelSection(**family.model_section(config))
    table = family.table(model)
    weights = hf_io.HFWeights(Source(hf_dir))
    by_name = {table.normalize_hf(k): k for k in weights.keys()}
    out = {}
    for rule in table.rules:
        keys = [rule.megatron.replace("*", str(i)) for i in range(model.num_layers)] if "*" in rule.megatron else [rule.megatron]
        for key in keys:
            if not all(by_name.get(h) for h in table.hf_keys_for(key)):
                continue  # e.g. position embeddings of a RoPE model
            t = table.to_megatron(key, lambda n: weights.get(by_name[n]))
            if is_vocab_key(key):
                t = fit_vocab_rows(t, rows=padded_rows, vocab_size=model.vocab_size, key=key)
            out[key] = t
    assert all(re.match(r"(embedding|decoder|encoder|output_layer|lm_head|pooler|binary_head)\.", k) for k in out)
    return out, model


def _shard(key: str, t, tp: int, rank: int, swiglu: bool):
    import torch

    if key.endswith(("linear_fc1.weight", "linear_fc1.bias")) and swiglu:
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]).clone()
    if key.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
                     "linear_fc1.weight", "linear_fc1.bias")):
        return t.chunk(tp, dim=0)[rank].clone()
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return t.chunk(tp, dim=1)[rank].clone()
    return t.clone()


_LEGACY_MODEL_NAMES = [  # canonical -> megatron/legacy/model names (inside language_model.encoder)
    ("self_attention.linear_qkv.layer_norm_", "input_norm."),
    ("self_attention.linear_qkv.", "self_attention.query_key_value."),
    ("self_attention.linear_proj.", "self_attention.dense."),
    ("mlp.linear_fc1.layer_norm_", "post_attention_norm."),
    ("mlp.linear_fc1.", "mlp.dense_h_to_4h."),
    ("mlp.linear_fc2.", "mlp.dense_4h_to_h."),
]


def _legacy_model_state(local: dict, stack: str = "decoder") -> dict:
    """Canonical (local layer numbers) -> the legacy model's nested state_dict_for_save_checkpoint:
    GPTModel's (``stack`` decoder), or BertModel's (``stack`` encoder; with its pooler, masked-LM
    head whose vocabulary bias is lm_head.bias and norm lm_head.norm, and binary head)."""
    lm: dict = {}
    encoder: dict = {}
    out: dict = {}
    for key, t in local.items():
        top, _, rest = key.partition(".")
        if top == "embedding":
            kind, _, rest = rest.partition(".")
            lm.setdefault("embedding", {}).setdefault(kind, {})[rest] = t
        elif key.startswith(f"{stack}.layers."):
            num, _, rest = key[len(f"{stack}.layers."):].partition(".")
            for canon, legacy in _LEGACY_MODEL_NAMES:
                if rest.startswith(canon):
                    rest = legacy + rest[len(canon):]
                    break
            encoder[f"layers.{num}.{rest}"] = t
        elif key.startswith(f"{stack}.final_layernorm."):
            encoder["final_norm." + key.rsplit(".", 1)[1]] = t
        elif key == "output_layer.weight":
            lm.setdefault("output_layer", {})["weight"] = t
        elif key == "output_layer.bias":
            out.setdefault("lm_head", {})["bias"] = t
        elif top == "pooler":
            lm.setdefault("pooler", {})[rest] = t
        elif top == "lm_head":
            out.setdefault("lm_head", {})[rest.replace("layer_norm.", "norm.")] = t
        elif top in ("binary_head", "word_embeddings_for_head"):
            out.setdefault(top, {})[rest] = t
    if encoder:
        lm["encoder"] = encoder
    return {"language_model": lm, **out}


def write_legacy(hf_dir: Path, out: Path, *, tp: int, pp: int, iteration: int = 10, style: str = "mcore",
                 extra_args: dict | None = None) -> None:
    """Write a Megatron-LM legacy (torch format) checkpoint of an HF model at TP×PP, as
    megatron/training/checkpointing.py lays it out: latest_checkpointed_iteration.txt,
    iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt with args, checkpoint_version 3.0, model,
    optimizer, rng_state. ``style``: "mcore" (Megatron-Core keys, TE spec, with _extra_state) or
    "legacy" (megatron/legacy/model nested language_model dicts)."""
    import numpy as np
    import torch
    from megatron.core.transformer.enums import AttnBackend

    divisible_by = 128
    from megacli.convert import hf_io

    vocab = hf_io.read_json(hf_dir / "config.json")["vocab_size"]
    padded = -(-vocab // (divisible_by * tp)) * divisible_by * tp
    tensors, model = _canonical_from_hf(hf_dir, padded_rows=padded)
    m = model
    args = argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        group_query_attention=m.query_groups != m.num_attention_heads, num_query_groups=m.query_groups,
        kv_channels=m.head_dim, ffn_hidden_size=m.ffn_size, seq_length=m.seq_length,
        max_position_embeddings=m.max_positions,
        position_embedding_type="rope" if m.position_embedding == "rope" else "learned_absolute",
        rotary_base=int(m.rotary_base), rotary_percent=1.0, normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm",
        norm_epsilon=m.norm_epsilon, swiglu=m.activation == "swiglu", openai_gelu=m.activation == "gelu_tanh",
        add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_qkv_bias,
        untie_embeddings_and_output_weights=m.untie_embeddings, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        make_vocab_size_divisible_by=divisible_by, padded_vocab_size=padded, vocab_size=vocab - 1,  # NullTokenizer adds EOD
        params_dtype=torch.float32, bf16=False, fp16=False, tokenizer_type="NullTokenizer", hidden_dropout=0.0,
        attention_dropout=0.0, attention_backend=AttnBackend.auto, iteration=iteration, ckpt_format="torch",
        **(extra_args or {}))
    per_stage = m.num_layers // pp
    it_dir = out / iter_name(iteration)
    for p in range(pp):
        local = {}
        for key, t in tensors.items():
            if key.startswith("decoder.layers."):
                num, _, rest = key[len("decoder.layers."):].partition(".")
                if p * per_stage <= int(num) < (p + 1) * per_stage:
                    local[f"decoder.layers.{int(num) - p * per_stage}.{rest}"] = t
            elif key.startswith("embedding.") and p == 0:
                local[key] = t
            elif key.startswith(("decoder.final_layernorm", "output_layer")) and p == pp - 1:
                local[key] = t
        if p == pp - 1 and pp > 1 and not m.untie_embeddings and style == "mcore":
            local["output_layer.weight"] = tensors["embedding.word_embeddings.weight"]  # the tied copy on the last stage
        for r in range(tp):
            state = {k: _shard(k, t, tp, r, m.activation == "swiglu") for k, t in local.items()}
            if style == "mcore":
                for k in list(state):
                    if k.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")):
                        state[k.rsplit(".", 1)[0] + "._extra_state"] = io.BytesIO(b"")  # TE's extra state
                model_state = state
            else:
                model_state = _legacy_model_state(state)
                if p == pp - 1 and pp > 1 and not m.untie_embeddings:
                    emb = tensors["embedding.word_embeddings.weight"]
                    model_state["word_embeddings_for_head"] = {"weight": _shard("word_embeddings.weight", emb, tp, r, False)}
            name = f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{p:03d}"
            (it_dir / name).mkdir(parents=True, exist_ok=True)
            torch.save({
                "args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": model_state,
                "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0]}]},
                "opt_param_scheduler": {"num_steps": iteration},
                "rng_state": [{"random_rng_state": (3, tuple(range(5)), None), "np_rng_state": np.random.get_state(),
                               "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.zeros(4, dtype=torch.uint8),
                               "rng_tracker_states": {}}],
                "num_floating_point_operations_so_far": 0.0,
            }, it_dir / name / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def drop_tokenizer_files(hf_dir: Path) -> None:
    """Leave only the config and the weights (a directory saved without its tokenizer)."""
    for p in hf_dir.iterdir():
        if p.name not in ("config.json", "model.safetensors", "generation_config.json"):
            p.unlink()


def check_converts_without_tokenizer(hf_dir: Path, out: Path, arch: str) -> None:
    """`megacli convert` of a directory without tokenizer files succeeds with tokenizer.type none;
    pretraining from its recipe is then refused (exit 2, one message): masking needs a tokenizer."""
    import subprocess
    import sys

    import yaml

    drop_tokenizer_files(hf_dir)
    run = [sys.executable, "-m", "megacli"]
    done = subprocess.run([*run, "convert", str(hf_dir), str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    recipe = out / "iter_0000000" / "recipe.yaml"
    assert yaml.safe_load(recipe.read_text())["tokenizer"]["type"] == "none"
    refused = subprocess.run([*run, "pretrain", str(recipe), "--dry-run"], capture_output=True, text=True, timeout=600)
    message = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 2 and "Traceback" not in message, message
    assert f"tokenizer.type = 'none': {arch} masking needs a tokenizer" in message, message
