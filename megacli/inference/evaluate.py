"""The eval job: lm-evaluation-harness tasks on a checkpoint, the model run on every rank of its
TP/PP layout (``lm_eval_backend``), rank 0 driving the harness, printing its table and writing its
JSON with per-task seconds and tokens/s. ``check_tasks`` runs before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

from megacli.engine import distributed
from megacli.errors import UserError
from megacli.paths import shown


def import_harness():
    """The lm_eval package, or a UserError saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise UserError("megacli eval runs lm-evaluation-harness: pip install 'megacli[eval]'") from None
    return lm_eval


def task_manager(ev):
    from megacli.inference.task_code import check_task_code
    from megacli.inference.task_templates import sandboxed

    if ev.include_path and not Path(ev.include_path).is_dir():
        raise UserError(f"eval.include_path = {shown(ev.include_path)}: no such directory")
    check_task_code(ev)  # before the harness reads (and imports from) any task YAML
    with sandboxed(ev):
        return _task_manager(ev)


def _task_manager(ev):
    from lm_eval.tasks import TaskManager

    if ev.include_path:
        # Indexing the harness's own ~15k task YAMLs takes half a minute: skip it when the
        # include path alone defines (and loads) every task asked for.
        local = TaskManager(include_path=ev.include_path, include_defaults=False)
        if all(t in local.all_tasks for t in ev.tasks):
            if all(local.task_index[t].kind.name in ("TASK", "PY_TASK") for t in ev.tasks):
                return local  # plain tasks: whether their data loads is check_tasks' question
            try:
                local.load_task_or_group(list(ev.tasks))
                return local
            except Exception:  # e.g. a local group of built-in tasks: index everything
                pass
    return TaskManager(include_path=ev.include_path)


def check_tasks(ev) -> None:
    """Every task is known and its data loads (downloaded or local), or a UserError naming the
    task and the dataset to fetch."""
    from megacli.inference.task_templates import refused, sandboxed, security_error

    import_harness()
    manager = task_manager(ev)
    unknown = [t for t in ev.tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {ev.include_path}" if ev.include_path else " (give your own task YAMLs with --include-path)"
        raise UserError(f"eval.tasks: unknown lm-evaluation-harness task(s) {', '.join(unknown)}: not among the "
                        f"harness's tasks{where}")
    with sandboxed(ev):
        for name in ev.tasks:
            try:
                manager.load_task_or_group([name])
            except Exception as exc:  # the datasets library raises many kinds; all mean the same to the user
                if security_error(exc):
                    raise refused(exc, name) from None
                raise UserError(_missing_data(name, manager, exc)) from None


def _missing_data(name: str, manager, exc: Exception) -> str:
    cfg = manager.task_index[name].cfg or {}
    dataset = cfg.get("dataset_path")
    subset = cfg.get("dataset_name")
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    if dataset is None:
        return f"task {name}: its data cannot be loaded ({first_line})"
    spelled = f"{dataset!r}" + (f", {subset!r}" if subset else "")
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if files:
        return f"task {name}: its data files {files} cannot be loaded ({first_line})"
    return (f"task {name}: dataset {spelled} is not available here ({first_line}); fetch it into the Hugging Face "
            f"datasets cache first (datasets.load_dataset({spelled}) on a machine with network), or point "
            f"--include-path at task YAMLs with local data files")


def run(recipe) -> None:
    with distributed.running(parallel=recipe.parallel, launch=recipe.launch, seed=recipe.eval.seed) as runtime:
        _run(recipe, runtime)


def _run(recipe, runtime) -> None:
    from megacli.data.tokenizers import load_tokenizer
    from megacli.inference.lm_eval_backend import MegacliLM, Work
    from megacli.inference.lockstep import Lockstep
    from megacli.inference.runner import Model
    from megacli.plan import model_vocab_size

    ev = recipe.eval
    tok = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path, vocab_size=recipe.model.vocab_size)
    model = Model(recipe, runtime, vocab_size=model_vocab_size(recipe, tok))
    lockstep = Lockstep(Work(model, tok, seed=ev.seed), world_size=runtime.world_size)
    if runtime.rank != 0:
        lockstep.follow()
        return
    lm = MegacliLM(lockstep, tok, max_length=recipe.model.max_positions, batch_size=ev.batch_size,
                   max_gen_toks=ev.max_gen_toks, add_bos=ev.add_bos)
    try:
        results = evaluate(lm, ev)
    finally:
        lockstep.stop()
    report(results, lm.timing.report(), output=ev.output)


def evaluate(lm, ev, *, manager=None, log_samples: bool | None = None, bootstrap_iters: int | None = None) -> dict:
    """The harness's simple_evaluate on ``lm`` (log_samples and bootstrap_iters: the eval
    section's unless given)."""
    from unittest import mock

    import lm_eval.evaluator
    from lm_eval import simple_evaluate

    from megacli.inference.task_templates import sandboxed

    with sandboxed(ev), mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", _git_commit_hash):
        return simple_evaluate(model=lm, tasks=list(ev.tasks), num_fewshot=ev.num_fewshot, limit=ev.limit,
                               task_manager=manager or task_manager(ev),
                               log_samples=ev.log_samples if log_samples is None else log_samples, random_seed=ev.seed,
                               numpy_random_seed=ev.seed, torch_random_seed=ev.seed, fewshot_random_seed=ev.seed,
                               bootstrap_iters=ev.bootstrap_iters if bootstrap_iters is None else bootstrap_iters)


def _git_commit_hash() -> str | None:
    """The commit of the working directory, for the results JSON, as the harness records it, but
    without git's "fatal: not a git repository" on the terminal when there is none."""
    import subprocess

    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def metrics(results: dict) -> dict[str, float]:
    """The harness's numeric metrics as eval/<task>/<metric> (a filter other than `none` as
    <metric>,<filter>), standard errors left out."""
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            out[f"eval/{task}/{metric if filt == 'none' else key}"] = float(value)
    return out


class InTraining:
    """``recipe.eval`` during training: at each call, the harness tasks on the training model's
    chunk, in eval mode, in its own layout (rank 0 drives the harness, every rank runs the model);
    returns the metrics (see ``metrics``) on every rank."""

    def __init__(self, recipe, trainer, tokenizer):
        from megacli.engine.models.common import unwrap

        import_harness()
        self.recipe, self.trainer, self.tok = recipe, trainer, tokenizer
        self.manager = task_manager(recipe.eval) if trainer.runtime.rank == 0 else None
        self.net = unwrap(trainer.chunks[0])

    def __call__(self, iteration: int) -> dict[str, float]:
        import torch.distributed as dist

        from megacli.inference.lm_eval_backend import MegacliLM, Work
        from megacli.inference.lockstep import Lockstep
        from megacli.inference.runner import Model

        ev, runtime = self.recipe.eval, self.trainer.runtime
        rng = _RandomState()  # the harness seeds the global generators on rank 0: training's own go on after
        for chunk in self.trainer.chunks:
            chunk.eval()
        try:
            model = Model(self.recipe, runtime, vocab_size=self.trainer.vocab_size, net=self.net)
            lockstep = Lockstep(Work(model, self.tok, seed=ev.seed), world_size=runtime.world_size)
            scores = None
            if runtime.rank == 0:
                lm = MegacliLM(lockstep, self.tok, max_length=self.recipe.model.max_positions, batch_size=ev.batch_size,
                               max_gen_toks=ev.max_gen_toks, add_bos=ev.add_bos)
                try:
                    scores = metrics(evaluate(lm, ev, manager=self.manager, log_samples=False, bootstrap_iters=0))
                finally:
                    lockstep.stop()
            else:
                lockstep.follow()
        finally:
            for chunk in self.trainer.chunks:
                chunk.train()
            rng.restore()
        if runtime.world_size > 1:
            box = [scores]
            dist.broadcast_object_list(box, src=0)
            scores = box[0]
        return scores


def report(results: dict, timing: dict, *, output: str | None) -> None:
    """The harness's table, a line per task with its speed, and the JSON (timing under `megacli`)."""
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results), flush=True)
    if "groups" in results:
        print(make_table(results, "groups"), flush=True)
    for task, t in timing.items():
        speed = f"{t['tokens_per_second']:.1f} tokens/s" if t["tokens_per_second"] else "-"
        print(f"{task}: {t['seconds']:.2f} s, {t['tokens']} tokens, {speed}", flush=True)
    if output:
        record = {**results, "megacli": {"timing": timing}}
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(record, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")


class _RandomState:
    """Python's, NumPy's and torch's global random generators, saved now and restored by restore()."""

    def __init__(self):
        import random

        import numpy as np
        import torch

        self.python, self.numpy, self.torch = random.getstate(), np.random.get_state(), torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        import random

        import numpy as np
        import torch

        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
