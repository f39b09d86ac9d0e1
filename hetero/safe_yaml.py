"""YAML that cannot hang or crash the tool: aliases, nesting, syntax and interpolations measured first.

PyYAML shares an aliased node instead of copying it, so a "billion laughs" file parses in
milliseconds; what hangs is whoever walks the result (OmegaConf copies every alias, the fleet
builder and serde visit each value). So the node graph is measured first, each node once: its
size once aliases are expanded, its depth, and alias cycles. OmegaConf's ``${key}`` interpolations
can blow up the same way when resolved (a string of ten references to a string of ten references
...), so a composed config's references are measured the same way before it is resolved.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from hetero.errors import ConfigError

# A fleet, datasheet or model file has tens to hundreds of values and a handful of levels.
MAX_EXPANDED_VALUES = 10_000
MAX_DEPTH = 32
MAX_RESOLVED_SIZE = 1_000_000  # characters and values of a config once every ${...} is resolved
# A reference ${a.b}, ${a.hosts[0]} or relative ${..a}; one inside a resolver's arguments counts too.
_REFERENCE = re.compile(r"\$\{\s*(\.*)([\w\-]+(?:\.[\w\-]+|\[\d+\])*)\s*\}")


def yaml_error_message(path: str | Path, exc: yaml.YAMLError) -> str:
    """One line: ``<file>:<line>: malformed YAML (<problem>)``."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    line = f":{mark.line + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{path}{line}: malformed YAML ({problem})"


def check_yaml(path: str | Path, text: str) -> None:
    """Raise a one-line ConfigError if ``text`` is malformed, nests too deep, or aliases expand too far."""
    try:
        _check_depth(path, text)  # first, from the event stream: composing recurses once per level
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error_message(path, exc)) from None
    if root is not None:
        _measure(path, root)


def load_yaml(path: str | Path, text: str) -> Any:
    """``yaml.safe_load`` after ``check_yaml``: plain Python values, or a one-line ConfigError."""
    check_yaml(path, text)
    return yaml.safe_load(text)


def _check_depth(path: str | Path, text: str) -> None:
    level = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            level += 1
            if level > MAX_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark else 0
                raise ConfigError(f"{path}:{line}: nested more than {MAX_DEPTH} levels deep; flatten it")
        elif isinstance(event, yaml.CollectionEndEvent):
            level -= 1


def _measure(path: str | Path, root: yaml.Node) -> None:
    """Depth, alias cycles, and what aliases add once expanded; each node visited once, without recursion."""
    size: dict[int, int] = {}  # id(node) -> values in its subtree with every alias expanded
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = isinstance(node, yaml.CollectionNode) + max((depth[id(k)] for k in kids), default=0)
            if depth[key] > MAX_DEPTH:
                raise ConfigError(f"{path}:{node.start_mark.line + 1}: nested more than {MAX_DEPTH} levels deep; "
                                  "flatten it")
        elif key in on_path:
            raise ConfigError(f"{path}:{node.start_mark.line + 1}: a YAML alias refers to its own anchor; "
                              "a value cannot contain itself")
        elif key not in size:  # else: an alias of a node already measured
            on_path.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node))
    if size[id(root)] - len(size) > MAX_EXPANDED_VALUES:
        raise ConfigError(f"{path}: YAML aliases expand it by more than {MAX_EXPANDED_VALUES} values (an alias "
                          "bomb?); write the repeated part out, or alias less of it")


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_interpolations(config: Any, where: str = "config") -> None:
    """Raise a one-line ConfigError if resolving ``config``'s ``${...}`` references would build something huge.

    ``config`` is the composed config as plain values, interpolations unresolved. Each node's resolved
    size (characters of a string, plus what its references resolve to; values of a container) is
    computed once; a reference cycle counts once (OmegaConf reports it when it resolves).
    """
    size: dict[tuple[Any, ...], int] = {}
    on_path: set[tuple[Any, ...]] = set()
    stack: list[tuple[tuple[Any, ...], bool]] = [((), False)]
    while stack:
        path, deps_done = stack.pop()
        if path in size and not deps_done:
            continue
        node = _lookup(config, path)
        deps = _dependencies(config, path, node)
        if deps_done:
            on_path.discard(path)
            own = len(node) if isinstance(node, str) else 1
            size[path] = own + sum(size.get(d, 1) for d in deps)  # .get: a cycle's back edge counts 1
            if size[path] > MAX_RESOLVED_SIZE:
                key = ".".join(map(str, path)) or where
                raise ConfigError(f"{key}: its ${{...}} interpolations resolve to more than {MAX_RESOLVED_SIZE} "
                                  "characters and values; reference less")
            continue
        on_path.add(path)
        stack.append((path, True))
        stack.extend((d, False) for d in deps if d not in on_path and d not in size)


_MISSING = object()


def _lookup(config: Any, path: tuple[Any, ...]) -> Any:
    node = config
    for key in path:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        else:
            return _MISSING
    return node


def _dependencies(config: Any, path: tuple[Any, ...], node: Any) -> list[tuple[Any, ...]]:
    """Children of a container; the nodes a string's references name (those that exist)."""
    if isinstance(node, dict):
        return [(*path, k) for k in node]
    if isinstance(node, list):
        return [(*path, i) for i in range(len(node))]
    if not isinstance(node, str) or "${" not in node:
        return []
    found = []
    for dots, dotted in _REFERENCE.findall(node):
        keys: list[Any] = [int(k) if k.isdigit() else k for k in re.split(r"\.|\[|\]\.?", dotted) if k]
        base = list(path[: len(path) - len(dots)]) if dots else []  # ${.x}: a sibling; ${..x}: the parent's
        target = (*base, *keys)
        if _lookup(config, target) is not _MISSING:
            found.append(target)
    return found
