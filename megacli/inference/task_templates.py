"""lm-evaluation-harness task templates rendered in Jinja's sandbox while megacli drives the harness.

Every template-bearing field of a task (doc_to_text, doc_to_target, doc_to_choice, doc_to_image,
doc_to_audio, doc_to_decontamination_query, description, gen_prefix and fewshot_config's, and a
``use_prompt`` prompt's doc_to_text/doc_to_target) is rendered by ``lm_eval.utils.apply_template``
through one module-level environment, ``lm_eval.utils.env``, a plain ``jinja2.Environment`` in which
``{{ cycler.__init__.__globals__.os.system(...) }}`` runs a command. ``sandboxed`` puts a
``SandboxedEnvironment`` with the same settings and filters in its place for the time megacli
drives the harness (task indexing, loading, evaluation), so such a template raises SecurityError,
which becomes one message naming the cause. Plain templates (fields, indexing, filters, string
methods, loops) render exactly as before. ``--trust-task-code`` leaves the harness's own environment.
"""

from __future__ import annotations

from contextlib import contextmanager

from megacli.errors import UserError

# The task fields the harness renders as templates (lm_eval.api.task; fewshot_config's included).
TEMPLATE_FIELDS = ("doc_to_text", "doc_to_target", "doc_to_choice", "doc_to_image", "doc_to_audio",
                   "doc_to_decontamination_query", "description", "gen_prefix")


def sandbox_of(env):
    """A SandboxedEnvironment rendering like ``env`` (its undefined, newline and filters)."""
    from jinja2 import BaseLoader
    from jinja2.sandbox import SandboxedEnvironment

    box = SandboxedEnvironment(loader=BaseLoader(), undefined=env.undefined,
                               keep_trailing_newline=env.keep_trailing_newline)
    for name, function in env.filters.items():  # the harness's own (regex_replace); the sandbox's stay
        box.filters.setdefault(name, function)
    return box


@contextmanager
def sandboxed(ev):
    """The harness's template rendering in the sandbox for the block (unless ``ev.trust_task_code``);
    a template refused there is a UserError."""
    import lm_eval.utils as harness
    from jinja2.exceptions import SecurityError

    if ev.trust_task_code:
        yield
        return
    plain = harness.env
    harness.env = sandbox_of(plain)
    try:
        yield
    except SecurityError as exc:
        raise refused(exc) from None
    finally:
        harness.env = plain


def refused(exc: Exception, task: str | None = None) -> UserError:
    """The message for a task template the sandbox stopped (in ``task`` when known)."""
    where = f"task {task}: " if task else ""
    return UserError(f"{where}a task template tried to reach Python internals and was stopped ({exc}); lm-evaluation-"
                     f"harness templates render in Jinja's sandbox. If you trust the task files, rerun with "
                     f"--trust-task-code (or set eval.trust_task_code: true)")


def security_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the sandbox's refusal, or was raised while handling one."""
    from jinja2.exceptions import SecurityError

    while exc is not None:
        if isinstance(exc, SecurityError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
