"""`megacli pretrain --dry-run` counts the parameters of the model the engine builds: GPT, BERT
(token types, LM head, pooler and binary head, output bias; pre- and post-LN) and T5 (decoder layers with
cross-attention, two final norms, relative position biases, the tied LM head's bias). The
reference is the real Megatron-Core model, built on CPU in one process."""

from __future__ import annotations

import re

TINY = ["data.mock=false", "data.path=x", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.ffn_hidden_size=96", "model.seq_length=64", "model.vocab_size=200", "launch.nproc=1", "parallel.tensor=1",
        "parallel.pipeline=1", "parallel.sequence_parallel=false", "launch.device=cpu"]
CASES = {
    "gpt": ["model.activation=swiglu", "model.untie_embeddings=true", "model.num_query_groups=2", "model.qk_layernorm=true",
            "model.add_bias_linear=false", "model.normalization=rmsnorm", "model.position_embedding=rope"],
    "bert": ["model.arch=bert"],
    "bert_untied_no_binary_head": ["model.arch=bert", "model.bert_binary_head=false", "model.untie_embeddings=true",
                                   "model.normalization=rmsnorm"],
    "bert_post_ln_masked_lm": ["model.arch=bert", "model.norm_position=post", "model.bert_binary_head=false",
                               "model.bert_token_types=2", "model.activation=gelu_tanh"],
    "t5": ["model.arch=t5", "model.decoder_num_layers=3", "model.position_embedding=relative", "model.decoder_seq_length=24"],
    "t5_untied_learned_swiglu": ["model.arch=t5", "model.untie_embeddings=true", "model.activation=swiglu",
                                 "model.add_bias_linear=false", "model.decoder_seq_length=24"],
}


def _recipe(case: str):
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    return base.load(TrainingRecipe, None, [*TINY, *CASES[case]])


def _built_params(rank, world_size) -> dict[str, int]:
    from megacli.engine import distributed
    from megacli.engine.models import build_model
    from megacli.engine.models.config import transformer_config

    counts = {}
    for i, case in enumerate(CASES):
        recipe = _recipe(case)
        if i == 0:
            distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=1)
        config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="fp32", on_cuda=False)
        chunks = build_model(recipe=recipe, config=config, vocab_size=recipe.model.vocab_size)
        counts[case] = sum(p.numel() for c in chunks for p in c.parameters())
    distributed.teardown()
    return counts


def test_dry_run_parameter_count_is_the_built_models(tmp_path):
    from typer.testing import CliRunner

    from megacli.cli import _register, app
    from megacli.recipe.base import dump
    from tests._dist import spawn

    built = spawn(_built_params, 1)[0]
    _register()
    for case in CASES:
        recipe = tmp_path / f"{case}.yaml"
        recipe.write_text(dump(_recipe(case)))
        res = CliRunner().invoke(app, ["pretrain", str(recipe), "--dry-run"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output[-2000:]
        shown = re.search(r"parameters \(model\)\s*│\s*([\d,]+)", res.stdout)
        assert shown, res.stdout[-2000:]
        assert int(shown.group(1).replace(",", "")) == built[case], (case, shown.group(1), built[case])


def test_t5_vocabulary_counts_the_sentinels_the_tokenizer_lacks():
    from megacli.data.tokenizers import ByteTokenizer
    from megacli.plan import count_params, model_vocab_size

    class WithSentinels(ByteTokenizer):  # a tokenizer that already has <extra_id_0..9>
        def vocabulary(self):
            return {**super().vocabulary(), **{self.vocab_size + k: f"<extra_id_{k}>" for k in range(10)}}

    recipe = _recipe("t5")
    tok = ByteTokenizer()
    assert model_vocab_size(recipe, tok) == 200  # model.vocab_size wins
    plain = recipe.model_copy(update={"model": recipe.model.model_copy(update={"vocab_size": None})})
    sentinels = recipe.masking.sentinel_tokens
    assert model_vocab_size(plain, tok) == tok.vocab_size + sentinels
    assert model_vocab_size(plain, WithSentinels()) == tok.vocab_size + sentinels - 10
    # the byte vocabulary + 100 sentinels pad to 384 rows: a tied T5 LM head keeps one bias per row.
    assert count_params(plain, model_vocab_size(plain, tok)).output_layer == 384
    bert = _recipe("bert").model_copy(update={"model": _recipe("bert").model.model_copy(update={"vocab_size": None})})
    assert model_vocab_size(bert, tok) == tok.vocab_size
