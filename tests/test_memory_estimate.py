"""The --dry-run memory estimate against what autograd really keeps for backward: a GPT-2-shaped
model built by the engine on the CPU backend in bf16, its saved tensors counted (parameters left
out) for 2 and 4 layers. Per layer the estimate's 32·s·b·h bytes (no attention scores, no
dropout masks) must be what a layer keeps, within 2%; what is kept besides the layers must hold the saved fp32 softmax of the
logits (4·s·b·V, within the estimate's 6·s·b·V at the peak). The CUDA peak itself is
tests/test_gpu.py's."""

from __future__ import annotations

import pytest

from tests._dist import spawn
from tests._gpu import RECIPES

S, B, H, V = 256, 2, 256, 1000  # V pads to 1024 rows


def _saved_bytes(rank, world, layers: int):
    import torch
    from megatron.core.transformer.module import Float16Module

    from megacli import plan
    from megacli.engine import distributed
    from megacli.engine.models import build_model
    from megacli.engine.models.config import transformer_config
    from megacli.recipe.jobs import load_job_recipe

    recipe = load_job_recipe("pretrain", RECIPES / "gpt2_124m.yaml", [
        "launch.nproc=1", "launch.device=cpu", "data.path=null", "data.mock=true", "tokenizer.type=byte",
        "tokenizer.path=null", f"model.num_layers={layers}", f"model.hidden_size={H}", "model.num_attention_heads=4",
        f"model.seq_length={S}", f"model.max_position_embeddings={S}", f"model.vocab_size={V}",
        f"train.micro_batch_size={B}", f"train.global_batch_size={B}", "train.precision=bf16"])
    distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=0)
    config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="bf16", on_cuda=False)
    model = Float16Module(config, build_model(recipe=recipe, config=config, vocab_size=V)[0])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, V, (B, S))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, torch.arange(S)[None].expand(B, S), None, labels=tokens)
    distributed.teardown()
    return sum(saved.values()), plan.activation_bytes_per_layer(recipe, kernel=plan.attention_kernel(recipe, device="cpu")), plan.logits_bytes(recipe, 1024)


@pytest.mark.slow
def test_estimate_holds_what_autograd_keeps():
    (two, per_layer, logits), (four, _, _) = spawn(_saved_bytes, 1, 2)[0], spawn(_saved_bytes, 1, 4)[0]
    kept_per_layer = (four - two) / 2
    assert per_layer == 32 * S * B * H  # 34·sbh less the two hidden-dropout masks (no dropout here)
    # Within 2%: besides the formula's tensors a layer keeps only the flash kernel's softmax
    # statistics and a few small index tensors (~0.1·sbh here).
    assert abs(kept_per_layer - per_layer) <= 0.02 * per_layer, kept_per_layer / (S * B * H)
    rest = two - 2 * kept_per_layer
    softmax = 4 * S * B * 1024
    assert softmax <= rest <= softmax + 8 * S * B * H, rest / (S * B * H)  # + embeddings' and final norm's tensors
    assert logits == 6 * S * B * 1024
