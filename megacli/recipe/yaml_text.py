"""The one YAML loader for everything megacli reads (recipes, ``--set`` values, checkpoints' recipes,
the task YAMLs it scans): safe (no Python objects), a mapping may not hold a key twice, and aliases
may not expand the document past a small budget.

Aliases are cheap to parse: ``*a`` points at the node ``&a`` names, so nine lists of nine aliases
to the list before, eight deep, are twelve lines and a few dozen nodes, but 43 million values to
whatever walks them as a tree (validation, printing, a copy). The budget counts the nodes the
document would have with every alias written out, and refuses it when aliases add more than
``ALIAS_BUDGET`` of them (or refer to a node that holds itself); plain documents of any size pass.
"""

from __future__ import annotations

from typing import Any

import yaml

ALIAS_BUDGET = 10_000  # nodes aliases may add to a document (far beyond `<<: *defaults` use)


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int):
        self.key, self.line = key, line
        super().__init__(f"line {line}: key {key!r} appears twice in one mapping")


class AliasBomb(yaml.YAMLError):
    def __init__(self, reason: str):
        super().__init__(f"{reason}; write the values out instead of through aliases (*name)")


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def check_expansion(root: yaml.Node) -> None:
    """Raise AliasBomb when the document under ``root``, every alias written out, has more than
    ALIAS_BUDGET nodes beyond its distinct ones, or holds itself (a cycle through an alias)."""
    expanded: dict[int, int] = {}  # node id -> its node count with aliases written out
    open_ids: set[int] = set()
    stack = [(root, False)]
    while stack:  # iterative: a deep document is not a recursion error
        node, done = stack.pop()
        key = id(node)
        if done:
            open_ids.discard(key)
            expanded[key] = 1 + sum(expanded[id(child)] for child in _children(node))
            continue
        if key in expanded:
            continue
        if key in open_ids:
            raise AliasBomb("an alias refers to a value that contains it")
        open_ids.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in expanded)
    if expanded[id(root)] - len(expanded) > ALIAS_BUDGET:
        raise AliasBomb(f"aliases expand this document by {expanded[id(root)] - len(expanded)} values, more than "
                        f"the {ALIAS_BUDGET} allowed")


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses an alias bomb (check_expansion) and a mapping holding a key twice
    (plain YAML keeps the last one). The base of every loader megacli uses."""

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            check_expansion(node)
        return node

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then overriding keys is meant
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the constructor below says so
                continue
            if duplicate:
                raise DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml_text(text: str | bytes, loader: type[BoundedLoader] = BoundedLoader) -> Any:
    """One YAML document through ``loader`` (BoundedLoader or a subclass); YAMLError when refused."""
    return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: where, and what."""
    if isinstance(exc, DuplicateKey):
        return f"{exc}; keep one"
    if isinstance(exc, AliasBomb):
        return str(exc)
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return f"{where}not valid YAML ({getattr(exc, 'problem', None) or exc})"
