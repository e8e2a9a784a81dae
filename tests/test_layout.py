"""The package layout: no import cycle between megacli's modules, and no package importing one
above it. Imports are read from the source (ast), those inside functions included."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megacli"

# Top to bottom: a package imports only packages in layers below its own. Unlike the data flow
# (cli -> recipe -> engine), recipe, plan and precision (the dtype table) sit low: every layer
# reads recipe sections (and the model's rules there: padded vocabulary, per-layer patterns),
# plan's arithmetic (parameter counts, memory) and dtypes; rundir names the run directory's
# files, which plot reads and the engine writes. A sub-package sits in its package's layer:
# checkpoint/megatron_lm (every Megatron-LM format, resume included) imports nothing above
# checkpoint, and the engine, convert and reshard read Megatron-LM's formats through it.
LAYERS = (
    ("__main__",),
    ("cli",),
    ("worker",),
    ("launch", "slurm", "planner"),
    ("inference",),
    ("engine", "convert", "reshard"),
    ("checkpoint", "plot"),
    ("plan", "rundir"),
    ("recipe", "data", "backend"),
    ("filekind",),
    ("errors", "precision", "lifetime", "paths", "core_release", "__init__"),
)

# Imports between packages of one layer, allowed one way.
SIDEWAYS = {
    # convert builds the recipe's model (engine.models) for the keys, shapes and sharding of the
    # checkpoint it writes (through checkpoint.writer, as reshard does).
    ("convert", "engine"),
}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package by its __init__)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The megacli modules ``name`` imports: ``from pkg import sub`` names the submodule when
    there is one, else the package; a name that is no module names the module holding it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    # Imports under `if TYPE_CHECKING:` are for annotations only: no edge at run time.
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    targets = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    found = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if (target == "megacli" or target.startswith("megacli.")) and target != name:
            found.add(target)
    return found


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _package(module: str) -> str:
    """megacli.engine.models.gpt -> engine; megacli.worker -> worker; megacli -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


LAYER_OF = {package: depth for depth, layer in enumerate(LAYERS) for package in layer}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def _crossings(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import of a package in the same layer (not allowed in SIDEWAYS) or a higher one."""
    bad = []
    for module, targets in graph.items():
        for target in targets:
            a, b = _package(module), _package(target)
            if a == b or (a, b) in SIDEWAYS:
                continue
            if LAYER_OF[b] <= LAYER_OF[a]:
                bad.append((module, target))
    return sorted(bad)


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules()}
    assert packages - set(LAYER_OF) == set(), "add new packages to LAYERS"


def test_no_import_cycle():
    assert _cycle(_graph()) is None


def test_no_upward_or_sideways_import():
    assert _crossings(_graph()) == []


def test_the_walk_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The checks are only as good as the graph: an import inside a function, a relative import and
    ``from package import submodule`` must all be edges."""
    graph = _graph()
    assert "megacli.engine.models.bert" in graph["megacli.engine.models"]  # inside build_model
    assert "megacli.engine.models.moe" in graph["megacli.engine.models.config"]  # from package import submodule
    module = tmp_path / "gpt2.py"
    module.write_text("from . import gpt\nfrom ..models.common import unwrap\nfrom .. import loop\n")
    assert _imported("megacli.engine.models.gpt2", module, _modules()) == {
        "megacli.engine.models.gpt", "megacli.engine.models.common", "megacli.engine.loop"}
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import loop\nfrom . import gpt\n")
    assert _imported("megacli.engine.models.gpt2", module, _modules()) == {"megacli.engine.models.gpt"}
    cyclic = {"megacli.a": {"megacli.b"}, "megacli.b": {"megacli.c"}, "megacli.c": {"megacli.a"}}
    assert _cycle(cyclic) == ["megacli.a", "megacli.b", "megacli.c", "megacli.a"]
    assert _crossings({"megacli.engine.loop": {"megacli.inference.runner"}}) == [("megacli.engine.loop", "megacli.inference.runner")]
    assert _crossings({"megacli.engine.loop": {"megacli.convert.run"}}) == [("megacli.engine.loop", "megacli.convert.run")]
    assert _crossings({"megacli.convert.run": {"megacli.engine.loop"}}) == []
