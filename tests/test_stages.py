"""The one layer -> pipeline stage rule (megacli.recipe.stages) against Megatron-Core's own."""

import itertools

import pytest
import torch

from megacli.recipe.stages import chunk_layers, pick_split, split_problem, stage_of_layer


def _megatron_chunks(num_layers, pp, vp, first, last):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vp, num_layers_in_first_pipeline_stage=first,
                            num_layers_in_last_pipeline_stage=last, pipeline_dtype=torch.float32)
    out = []
    for rank in range(pp):
        stage = []
        for v in range(vp or 1):
            vs = v if vp else None
            offset = get_transformer_layer_offset(cfg, vp_stage=vs, pp_rank=rank)
            stage.append(range(offset, offset + get_num_layers_to_build(cfg, vp_stage=vs, pp_rank=rank)))
        out.append(stage)
    return out


def test_every_accepted_split_is_megatron_cores():
    checked = 0
    for num_layers, pp, vp in itertools.product(range(1, 11), range(2, 5), (None, 2)):
        for first, last in itertools.product((None, 1, 2, 3, 4), repeat=2):
            if split_problem(num_layers, pp, vp, first, last, hint=False) is None:
                assert chunk_layers(num_layers, pp, vp, first, last) == _megatron_chunks(num_layers, pp, vp, first, last)
                checked += 1
    assert checked > 200


@pytest.mark.parametrize("num_layers, pp, vp, split", [
    (3, 2, None, (1, None)), (26, 4, None, (5, None)), (61, 8, None, (5, None)), (12, 4, None, (None, None)),
    (12, 2, 4, (4, None)), (7, 2, 2, None),
])
def test_convert_picks_a_valid_split(num_layers, pp, vp, split):
    assert pick_split(num_layers, pp, vp) == split
    if split:
        assert split_problem(num_layers, pp, vp, *split) is None


def test_interleaving_needs_a_middle_stage():
    field, value, cause = split_problem(8, 2, 2, 4, 4)
    assert (field, value) == ("parallel.first_stage_layers", 4) and "a stage besides the first and last" in cause


def test_stage_of_layer():
    assert [stage_of_layer(i, 10, 3, 2, 2, 4) for i in range(10)] == [0, 1, 1, 2, 2, 0, 1, 1, 2, 2]
