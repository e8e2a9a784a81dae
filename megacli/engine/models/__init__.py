"""Recipe -> Megatron-Core model chunks: the only place that builds Megatron models.

A model is a list of chunks: one per virtual pipeline stage held by this rank (one without
interleaving), as Megatron's schedules expect. ``config`` builds the TransformerConfig, ``init``
draws the weights by name; ``gpt``, ``bert`` and ``t5`` build each architecture.
"""

from __future__ import annotations

from megacli.recipe.model import padded_vocab_size


def build_model(*, recipe, config, vocab_size: int) -> list:
    """Model chunks for this rank, the vocabulary padded to split evenly over TP ranks (the padded
    rows are masked out of the softmax)."""
    # Imported here: they import Megatron's model classes, which callers load only after
    # distributed.quiet_megatron_imports() (importing this package stays cheap).
    from megacli.engine.models import bert, gpt, t5

    builders = {"gpt": gpt.build_gpt, "bert": bert.build_bert, "t5": t5.build_t5}
    m = recipe.model
    padded = padded_vocab_size(vocab_size, divisible_by=m.make_vocab_size_divisible_by, tensor_parallel=recipe.parallel.tensor)
    return builders[m.arch](recipe=recipe, config=config, padded_vocab=padded, vocab_size=vocab_size)
