"""Checkpoint conversion: Hugging Face ⇄ megacli (Megatron-Core torch_dist), Megatron-LM legacy ->
either, for the model families in ``megacli.convert.families``.

    from megacli.checkpoint.source import Source
    from megacli.convert import convert
    convert(Source("hf/llama"), "ckpt/llama", parallel=ParallelSection(tensor=2, pipeline=2), dtype="bf16")
    convert(Source("ckpt/llama"), "hf/llama-out")               # back to Hugging Face

Modules: ``mapping`` (rule tables and tensor transforms), ``families`` (one module per HF
family), ``hf_io`` (HF directories), ``megatron_io`` (global tensors read from torch_dist checkpoints),
``weights_plan`` (converted weights as a checkpoint plan, for megacli.checkpoint.writer),
``structure`` (--print-structure), ``run`` (the conversions). Megatron-LM legacy checkpoints are
read by ``megacli.checkpoint.megatron_lm.legacy_reader``.
"""

from __future__ import annotations


def convert(*args, **kwargs):
    from megacli.convert.run import convert as _convert

    return _convert(*args, **kwargs)


__all__ = ["convert"]
