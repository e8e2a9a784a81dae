"""`megacli plan`'s model state is exact: for a tiny GPT-2-style GPT, a Llama-style GQA model, a MoE
and a T5, in layouts with TP2 × PP2, DP2 with the distributed optimizer, virtual pipeline stages and
EP2, the predicted bytes of weights, gradients and optimizer state of every rank equal the bytes of
the tensors that rank holds once the engine has built the model, its gradient buffers and its
optimizer (after one step, when Adam's moments exist) on the CPU backend."""

from __future__ import annotations

from megacli.recipe.jobs import repo_recipes_dir
from tests._dist import spawn

RECIPES = repo_recipes_dir()
COMMON = ["launch.nproc=4", "launch.device=cpu", "data.path=null", "data.mock=true", "tokenizer.type=none",
          "tokenizer.path=null", "model.vocab_size=1000", "train.precision=bf16", "train.global_batch_size=8",
          "train.micro_batch_size=1"]
GPT2 = ["model.position_embedding=learned", "model.normalization=layernorm", "model.activation=gelu",
        "model.add_bias_linear=true", "model.untie_embeddings=false"]
CASES = [  # (name, recipe, overrides)
    ("gpt2 TP2xPP2", "gpt_tiny.yaml", GPT2 + ["parallel.tensor=2", "parallel.pipeline=2"]),
    ("llama GQA TP2xDP2 dist-opt", "gpt_tiny.yaml", ["model.num_query_groups=2", "parallel.tensor=2",
                                                     "parallel.pipeline=1", "parallel.distributed_optimizer=true"]),
    ("gpt PP2xVP2xDP2 dist-opt", "gpt_tiny.yaml", ["parallel.tensor=1", "parallel.pipeline=2",
                                                   "parallel.virtual_pipeline=2", "parallel.distributed_optimizer=true"]),
    ("moe PP2xEP2xDP2 dist-opt", "moe_tiny.yaml", ["parallel.pipeline=2", "parallel.expert=2",
                                                   "parallel.distributed_optimizer=true"]),
    ("t5 TP2xDP2 dist-opt", "t5_tiny.yaml", ["tokenizer.type=byte", "data.mock=false", "data.path=unused", "parallel.tensor=2",
                                             "parallel.distributed_optimizer=true"]),
]


def _held_bytes(rank, world):
    """Per case: (weights, gradients, optimizer state) bytes this rank holds, and the prediction."""
    import torch
    from megatron.core import parallel_state

    from megacli.engine import distributed
    from megacli.engine.loop import _build_model
    from megacli.engine.optim import build_optimizer, torch_optimizers
    from megacli.planner.state import rank_state_bytes
    from megacli.recipe.jobs import load_job_recipe

    out = []
    for name, recipe_name, sets in CASES:
        recipe = load_job_recipe("pretrain", RECIPES / recipe_name, COMMON + sets)
        vocab = recipe.model.vocab_size
        runtime = distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=0)
        _, chunks = _build_model(recipe, runtime, vocab)
        optimizer = build_optimizer(chunks, optim=recipe.optim, precision="bf16",
                                    distributed_optimizer=recipe.parallel.distributed_optimizer, on_cuda=False)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.step()  # creates Adam's moments
        weights = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for c in chunks
                    for b in c.buffers + c.expert_parallel_buffers)
        state = 0
        for inner in torch_optimizers(optimizer):
            for group in inner.param_groups:
                for p in group["params"]:
                    state += p.numel() * p.element_size()  # the fp32 main copy (a shard with the distributed optimizer)
                    state += sum(t.numel() * t.element_size() for t in inner.state.get(p, {}).values()
                                 if torch.is_tensor(t) and t.dim() > 0)
        out.append((name, (weights, grads, state), rank_state_bytes(recipe, vocab, rank)))
        parallel_state.destroy_model_parallel()  # the next case's groups; the gloo world stays
    distributed.teardown()
    return out


def test_predicted_model_state_is_what_every_rank_holds():
    per_rank = spawn(_held_bytes, 4)
    for rank, cases in enumerate(per_rank):
        for name, held, predicted in cases:
            assert predicted == held, f"{name}, rank {rank}: predicted {predicted}, held {held}"
