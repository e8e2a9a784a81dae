"""`megacli generate`: complete prompts (or score text) with a trained or converted GPT checkpoint."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from megacli.cli.root import app
from megacli.cli.common import TRUST_PICKLE_HELP, RecipeArg, SetOpt, guarded


def _opt(help: str, *names: str):
    return typer.Option(*names, help=help, show_default=False)


@app.command(help="Generate text from a checkpoint (greedy, sampling or beam search), or score text "
                  "(--score, --cloze). megacli generate --checkpoint DIR --prompt TEXT [...] | megacli generate RECIPE")
@guarded
def generate(
    recipe: RecipeArg = None,
    checkpoint: Annotated[Optional[Path], _opt("Checkpoint directory; the model and tokenizer come from its recipe.", "--checkpoint", "-c")] = None,
    prompt: Annotated[Optional[List[str]], _opt("A prompt (repeatable).", "--prompt", "-p")] = None,
    prompts: Annotated[Optional[Path], _opt("JSONL with a `prompt` field, or text with one prompt per line.", "--prompts")] = None,
    max_new_tokens: Annotated[Optional[int], _opt("Tokens to generate at most.", "--max-new-tokens", "-n")] = None,
    temperature: Annotated[Optional[float], _opt("0 = greedy (default); above 0 samples.", "--temperature")] = None,
    top_k: Annotated[Optional[int], _opt("Sample among the k most likely tokens.", "--top-k")] = None,
    top_p: Annotated[Optional[float], _opt("Sample among the tokens holding probability p.", "--top-p")] = None,
    num_beams: Annotated[Optional[int], _opt("Beam search with this many beams.", "--num-beams")] = None,
    length_penalty: Annotated[Optional[float], _opt("Beam search length penalty (exponent).", "--length-penalty")] = None,
    repetition_penalty: Annotated[Optional[float], _opt("Penalise tokens already in the sequence.", "--repetition-penalty")] = None,
    seed: Annotated[Optional[int], _opt("Sampling seed.", "--seed")] = None,
    tensor: Annotated[Optional[int], _opt("Tensor-parallel size to run in (default 1).", "--tensor", "-t")] = None,
    pipeline: Annotated[Optional[int], _opt("Pipeline-parallel size to run in (default 1).", "--pipeline")] = None,
    output: Annotated[Optional[Path], _opt("Write one JSON object per prompt here.", "--output", "-o")] = None,
    logprobs: Annotated[bool, typer.Option("--logprobs", help="Write the generated tokens' log-probabilities.")] = False,
    chat: Annotated[bool, typer.Option("--chat", help="Each prompt is a user's message, rendered by the chat template "
                                                      "of the checkpoint's tokenizer.")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Recompute the whole sequence each step (no KV cache).")] = False,
    score: Annotated[Optional[Path], _opt("Report log-likelihood and perplexity of this text/JSONL file.", "--score")] = None,
    cloze: Annotated[Optional[Path], _opt("LAMBADA-style last-word accuracy on this JSONL file.", "--cloze")] = None,
    trusted: Annotated[bool, typer.Option("--trust-pickle", help=TRUST_PICKLE_HELP)] = False,
    set_: SetOpt = None,
) -> None:
    flags = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
             "num_beams": num_beams, "length_penalty": length_penalty, "repetition_penalty": repetition_penalty,
             "seed": seed, "output": output and str(output), "prompts_file": prompts and str(prompts),
             "score": score and str(score), "cloze": cloze and str(cloze), "checkpoint": checkpoint and str(checkpoint)}
    flags = {k: v for k, v in flags.items() if v is not None}
    if prompt:
        flags["prompts"] = list(prompt)
    if logprobs:
        flags["logprobs"] = True
    if chat:
        flags["chat"] = True
    if no_cache:
        flags["use_cache"] = False
    if output:  # before the checkpoint is read at all
        check_writable(output)
    job = build_recipe(recipe, flags, tensor=tensor, pipeline=pipeline, overrides=set_ or [], trusted=trusted)
    g = job.generate
    if g.output and not output:  # the recipe file's generate.output
        check_writable(Path(g.output))
    if not (g.prompts or g.prompts_file or g.score or g.cloze):
        if job.world_size > 1 or not sys.stdin.isatty():
            from megacli.errors import UserError

            raise UserError("no prompts: give --prompt TEXT, --prompts FILE, --score FILE or --cloze FILE")
        return _interactive(job)
    launch_job(job)


def build_recipe(recipe_path: Optional[Path], flags: dict, *, tensor: Optional[int], pipeline: Optional[int],
                 overrides: list[str], job: str = "generate", trusted: bool = False):
    """The checkpoint's recipe (less any trust it claims: megacli.recipe.trust), then the RECIPE file's
    sections, then the flags (the ``job`` section: generate, eval or serve), then --set. A Hugging Face
    directory or a Megatron-LM legacy checkpoint is converted into the run directory first
    (megacli.convert.in_run)."""
    import typer

    from megacli.recipe import trust
    from megacli.checkpoint.layout import find_checkpoint
    from megacli.checkpoint.megatron_lm.dist_reader import recipe_for_weights
    from megacli.checkpoint.safe_pickle import check_checkpoint
    from megacli.checkpoint.source import HF, LEGACY, MEGATRON_LM, kind_of, user_source
    from megacli.convert.in_run import converted_in_run
    from megacli.errors import UserError
    from megacli.recipe import base
    from megacli.recipe.jobs import recipe_model

    given = base.read_yaml(recipe_path) if recipe_path else {}
    if trusted:
        trust.grant_pickles(given, "checkpoint")
    user = base.apply_overrides(given, overrides)
    section = {**(given.get(job) or {}), **flags}
    source = section.get("checkpoint")
    if not source:
        where = "--checkpoint DIR" if job == "generate" else "the CHECKPOINT directory"
        raise UserError(f"which model? give {where} (or {job}.checkpoint in the recipe)")
    tp = tensor or (given.get("parallel") or {}).get("tensor") or 1
    pp = pipeline or (given.get("parallel") or {}).get("pipeline") or 1
    ckpt = find_checkpoint(source)
    kind = kind_of(Path(source))
    if ckpt is None and kind in (LEGACY, HF):
        run_dir = Path((user.get("run") or {}).get("dir", f"runs/{job}"))
        converted = converted_in_run(user_source(source, trust.pickles_granted(user)), run_dir, tensor=tp, pipeline=pp,
                                     dtype=(user.get("train") or {}).get("precision"),
                                     say=lambda line: typer.echo(line, err=True))
        source = section["checkpoint"] = str(converted)
        ckpt = find_checkpoint(converted)
    if ckpt is not None:
        carried = base.read_yaml(ckpt / "recipe.yaml")
    elif kind == MEGATRON_LM:  # the model from its run's args
        ckpt, carried = recipe_for_weights(user_source(source, trust.pickles_granted(user)))
    else:
        raise UserError(f"{source}: not a megacli checkpoint (no `latest` or megacli.json), a Megatron-LM torch_dist "
                        f"or legacy one, nor a Hugging Face model directory (config.json)")
    raw = _merge(trust.carried(carried), given)
    raw[job] = section
    if job != "generate":  # the inference runner loads generate.checkpoint
        raw["generate"] = {**(given.get("generate") or {}), "checkpoint": source}
    par = raw.setdefault("parallel", {})
    par.update(tensor=tp, pipeline=pp, virtual_pipeline=None, sequence_parallel=False, context=1,
               distributed_optimizer=False, recompute="none")
    par.update(_stage_split(raw, pp))
    raw.setdefault("launch", {})["nproc"] = tp * pp
    train = raw.setdefault("train", {})
    train["global_batch_size"] = train.get("micro_batch_size", 1)  # no training: keep the batch arithmetic trivially valid
    raw.setdefault("run", {})["dir"] = (given.get("run") or {}).get("dir", f"runs/{job}")
    raw = base.apply_overrides(raw, overrides)
    source = f"{recipe_path} (over {ckpt / 'recipe.yaml'})" if recipe_path else f"{ckpt / 'recipe.yaml'} + {job} options"
    recipe = base.validate(recipe_model(job), raw, source)
    check_checkpoint(user_source(ckpt, recipe.checkpoint))
    return recipe


def _stage_split(raw: dict, pp: int) -> dict:
    """Uneven pipeline stages for ``pp``: the recipe's when they fit it, else a split that does
    (an even one where the layers divide)."""
    from megacli.recipe.model import ModelSection
    from megacli.recipe.stages import pick_split, split_problem

    par = raw.get("parallel") or {}
    num_layers = (raw.get("model") or {}).get("num_layers", ModelSection.model_fields["num_layers"].default)
    first, last = par.get("first_stage_layers"), par.get("last_stage_layers")
    if split_problem(num_layers, pp, None, first, last, hint=False):
        first, last = pick_split(num_layers, pp) or (None, None)  # None: the recipe check says why
    return {"first_stage_layers": first, "last_stage_layers": last}


def check_writable(path: Path) -> None:
    """Refuse an output file that cannot be written before the model is loaded (minutes on a big model)."""
    from megacli.errors import UserError

    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"generate.output = {str(path)!r}: the directory {str(parent)!r} does not exist")
    if path.is_dir():
        raise UserError(f"generate.output = {str(path)!r} is a directory; give a file name")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise UserError(f"generate.output = {str(path)!r}: no permission to write there")


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def launch_job(job, name: str = "generate") -> None:
    """Run job ``name`` (generate or eval) here at one process, else in tensor × pipeline workers."""
    from megacli import launch, rundir

    if launch.inside_torchrun():
        from megacli.worker import run_guarded

        if run_guarded(name, job):
            raise launch.first_worker_error(job.run.dir)
        return
    recipe_file = rundir.prepare(job, job.run.dir)
    if job.world_size == 1:
        from megacli.worker import run_job

        with launch.as_single_worker():
            run_job(name, job)
        return
    launch.launch_workers(name, recipe_file, run_dir=job.run.dir, nproc=job.world_size, nnodes=1, node_rank=0,
                          rdzv_endpoint=None, job_id=launch.job_id(given=None, rdzv_endpoint=None),
                          timeout_minutes=job.launch.timeout_minutes)


def _interactive(job) -> None:
    """Read prompts from the terminal, one model load for the session."""
    from megacli import launch
    from megacli.engine import distributed
    from megacli.inference.generator import build_generator
    from megacli.inference.job import chat_prompts

    with launch.as_single_worker(), distributed.running(parallel=job.parallel, launch=job.launch,
                                                          seed=job.generate.seed) as runtime:
        gen = build_generator(job, runtime)
        print("type a prompt and Enter (Ctrl-D to quit)", flush=True)
        while True:
            try:
                text = input("> ")
            except EOFError:
                print()
                return
            if text.strip():
                out = gen.run_batch(chat_prompts(job.tokenizer.path, [text]) if job.generate.chat else [text])[0]
                print(out.text, flush=True)
