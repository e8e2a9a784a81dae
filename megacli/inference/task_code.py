"""Whether lm-evaluation-harness task YAMLs under an include path would run Python, found before
the harness reads them.

The harness imports code a task YAML names: ``!function module.name`` (``module.py`` beside the YAML,
or any importable module; ``class: !function ...`` builds a whole task) and, through Hugging Face
``evaluate.load``, a metric it does not register itself (a script path or a Hub metric). Every
``*.yaml`` the harness would index under the include path is parsed here with a safe loader that only
records such tags, following ``include:`` into the files it names, wherever they are. The harness's
own task files (installed with it, like its code) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from megacli.errors import UserError
from megacli.recipe.yaml_text import BoundedLoader, load_yaml_text, yaml_problem

_IGNORED_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # as the harness's own index


@dataclass(frozen=True)
class _Function:
    spec: str


class _Loader(BoundedLoader):
    """megacli's YAML loader (safe, aliases within a budget) keeping ``!function X`` (and any python/
    tag) as a record instead of importing."""


_Loader.add_constructor("!function", lambda loader, node: _Function(str(loader.construct_scalar(node))))
_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: _Function(f"!!python/{suffix}"))


def task_code(include_path: Path) -> list[str]:
    """One line per place a task YAML under ``include_path`` (or one it includes) names code."""
    found: list[str] = []
    seen: set[Path] = set()
    for path in sorted(p for p in Path(include_path).glob("**/*.yaml") if not _IGNORED_DIRS & set(p.parts)):
        _scan(path, found, seen)
    return found


def check_task_code(ev) -> None:
    """Refuse (UserError naming each file and function) include-path tasks that would import Python,
    unless the user trusts them (--trust-task-code / eval.trust_task_code)."""
    if not ev.include_path or ev.trust_task_code:
        return
    found = task_code(Path(ev.include_path))
    if found:
        shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
        raise UserError(f"eval.include_path = {ev.include_path!r}: task YAMLs there would import and run Python: "
                        f"{shown}. If you trust these files, rerun with --trust-task-code (or set "
                        f"eval.trust_task_code: true in the recipe)")


def _scan(path: Path, found: list[str], seen: set[Path]) -> None:
    path = path.expanduser().resolve()
    if path in seen or not path.is_file() or path.is_relative_to(_harness_tasks()):
        return
    seen.add(path)
    try:
        cfg = load_yaml_text(path.read_bytes(), _Loader)
    except OSError:
        return  # the harness cannot read it either
    except yaml.YAMLError as exc:  # what the harness's loader would read differently, or explode
        raise UserError(f"task YAML {path}: {yaml_problem(exc)}; megacli reads every task YAML under "
                        f"eval.include_path for code before the harness does: fix or remove it") from None
    if not isinstance(cfg, dict):
        return
    for where, spec in _functions(cfg, ()):
        found.append(f"{path}: {where}: !function {spec}")
    for where, metric in _unregistered_metrics(cfg):
        found.append(f"{path}: {where}: metric {metric!r} is not one of the harness's own, so Hugging Face "
                     f"evaluate would load (and run) it")
    prompt = cfg.get("use_prompt")
    if isinstance(prompt, str) and ".yaml" in prompt.partition(":")[0]:
        found.append(f"{path}: use_prompt: {prompt!r}: the harness reads that prompt file with PyYAML's full "
                     f"loader, which builds Python objects")
    includes = cfg.get("include")
    for inc in includes if isinstance(includes, list) else [includes]:
        if isinstance(inc, str):
            _scan(Path(inc) if Path(inc).is_absolute() else path.parent / inc, found, seen)


def _harness_tasks() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def _functions(node, where: tuple):
    if isinstance(node, _Function):
        yield ".".join(map(str, where)) or "(top level)", node.spec
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _functions(k, where)
            yield from _functions(v, (*where, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _functions(v, (*where, i))


def _unregistered_metrics(cfg: dict):
    from lm_eval.api import metrics  # noqa: F401 - fills the registry
    from lm_eval.api.registry import metric_registry

    entries = cfg.get("metric_list")
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        if isinstance(entry, dict) and isinstance(entry.get("metric"), str):
            if entry.get("hf_evaluate") is True or entry["metric"] not in metric_registry:
                yield f"metric_list.{i}.metric", entry["metric"]
