"""The activation memory `megacli plan` (and `--dry-run`) predicts per layer and micro-batch, against
what autograd saves for backward on CPU (torch.autograd.graph.saved_tensors_hooks): a GPT-2-shaped
bf16 model at TP2 with and without sequence parallelism, with recompute none, selective and full,
and with and without hidden dropout, counted per layer on each rank (parameters left out; a storage counted once, in the layer
that first saves it). Each layout's prediction must be within 10% of the count."""

from __future__ import annotations

from tests._dist import spawn
from tests._gpu import RECIPES

S, B, H, V, LAYERS = 256, 2, 256, 1000, 2
SETTINGS = [(sp, recompute, dropout) for sp in (True, False) for recompute in ("none", "selective", "full")
            for dropout in ((0.0, 0.1) if recompute == "none" else (0.0,))]


def _saved_per_layer(rank, world):
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    from megacli import plan
    from megacli.engine import distributed
    from megacli.engine.models import build_model
    from megacli.engine.models.config import transformer_config
    from megacli.recipe.jobs import load_job_recipe

    out = []
    for sp, recompute, dropout in SETTINGS:
        recipe = load_job_recipe("pretrain", RECIPES / "gpt2_124m.yaml", [
            "launch.nproc=2", "launch.device=cpu", "data.path=null", "data.mock=true", "tokenizer.type=byte",
            "tokenizer.path=null", f"model.num_layers={LAYERS}", f"model.hidden_size={H}", "model.num_attention_heads=4",
            f"model.seq_length={S}", f"model.max_position_embeddings={S}", f"model.vocab_size={V}",
            f"train.micro_batch_size={B}", f"train.global_batch_size={B}", "train.precision=bf16",
            "parallel.tensor=2", f"parallel.sequence_parallel={str(sp).lower()}", f"parallel.recompute={recompute}",
            "parallel.overlap_param_gather=false", "parallel.distributed_optimizer=false", f"model.dropout={dropout}"])
        distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=0)
        config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="bf16", on_cuda=False)
        model = Float16Module(config, build_model(recipe=recipe, config=config, vocab_size=V)[0])
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        layers = model.module.decoder.layers
        where, seen, per_layer = [None], set(), [0] * len(layers)

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if where[0] is not None and ptr not in params and ptr not in seen:
                seen.add(ptr)
                per_layer[where[0]] += t.untyped_storage().nbytes()
            return t

        # A layer's share: from its start to the next layer's (full recompute saves the layer's
        # input when its checkpointed forward returns), up to the final norm.
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda _m, _a, i=i: where.__setitem__(0, i))
        model.module.decoder.final_layernorm.register_forward_pre_hook(lambda _m, _a: where.__setitem__(0, None))
        tokens = torch.randint(0, V, (B, S))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens, torch.arange(S)[None].expand(B, S), None, labels=tokens)
        predicted = plan.activation_bytes_per_layer(recipe, kernel=plan.attention_kernel(recipe, device="cpu"), device="cpu")
        out.append(((sp, recompute, dropout), per_layer, predicted))
        parallel_state.destroy_model_parallel()
    distributed.teardown()
    return out


def test_activations_per_layer_within_10_percent_of_what_autograd_saves():
    for rank, cases in enumerate(spawn(_saved_per_layer, 2)):
        for (sp, recompute, dropout), per_layer, predicted in cases:
            for layer, counted in enumerate(per_layer):
                assert abs(predicted - counted) <= 0.10 * counted, (
                    f"rank {rank}, SP {sp}, recompute {recompute}, dropout {dropout}, layer {layer}: predicted {predicted / (S * B * H):.2f}·sbh, "
                    f"counted {counted / (S * B * H):.2f}·sbh")
