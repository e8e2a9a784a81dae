"""Who may lift megacli's guards against code in what it reads from outside: only the user.

Two guards: the pickle allow-list (megacli.checkpoint.safe_pickle; lifted by ``--trust-pickle`` /
``checkpoint.trust_pickle``) and the refusal of harness task YAMLs that import Python
(megacli.inference.task_code; lifted by ``--trust-task-code`` / ``eval.trust_task_code``). A flag on
the command line, the recipe file the user passed and ``--set`` may lift them. A recipe read out of a
checkpoint goes through ``carried``, whatever reads it (``recipe from``, ``recipe show`` or a training
run given the checkpoint's recipe.yaml as its recipe, ``finetune``/``generate``/``eval`` from it,
``convert``, ``reshard``): megacli.recipe.base.read_yaml applies it to every recipe file inside a
checkpoint (``from_checkpoint``), so a downloaded checkpoint cannot grant itself trust; and a recipe
written into a checkpoint (``dump(recipe, carried=True)``) leaves them out, so trust is never passed
on with one.
"""

from __future__ import annotations

from pathlib import Path

from megacli.paths import CHECKPOINT_RECORD

PICKLE = "trust_pickle"  # the field of the checkpoint, convert and reshard sections

# (section, field) of every recipe field that lifts a guard.
FIELDS = (("checkpoint", PICKLE), ("convert", PICKLE), ("reshard", PICKLE), ("eval", "trust_task_code"))


def carried(raw: dict) -> dict:
    """``raw``, a recipe read from a checkpoint or run directory, without any trust it claims."""
    out = dict(raw)
    for section, field in FIELDS:
        if isinstance(out.get(section), dict) and field in out[section]:
            out[section] = {k: v for k, v in out[section].items() if k != field}
    return out


def from_checkpoint(path: str | Path) -> bool:
    """Whether the recipe file at ``path`` is a checkpoint's (its directory holds a checkpoint record),
    so that what it says about trust counts for nothing."""
    return (Path(path).parent / CHECKPOINT_RECORD).is_file()


def granted(user: dict, section: str, field: str) -> bool:
    """Whether the user's own recipe (their file with --set and flags applied; never a carried one)
    sets ``section.field`` to true."""
    return (user.get(section) or {}).get(field) is True


def trusts_pickles(section) -> bool:
    """The user's pickle-trust decision in a validated section of their recipe (checkpoint, convert
    or reshard); megacli.checkpoint.source.user_source turns it into the Source that carries it."""
    return section.trust_pickle


def grant_pickles(raw: dict, section: str) -> None:
    """The --trust-pickle flag into the user's raw recipe: ``section``'s field set to true."""
    given = raw.get(section) or {}
    if isinstance(given, dict):  # anything else: validation names it
        raw[section] = {**given, PICKLE: True}


def pickles_granted(user: dict) -> bool:
    """Whether the user's own raw recipe trusts the pickles of the checkpoint it runs."""
    return granted(user, "checkpoint", PICKLE)
