"""YAML read from a user's files with its aliases counted before anything is built.

An alias (``*a``) repeats the node its anchor (``&a``) names; Hydra and OmegaConf copy every
repeat, so nine anchors of nine aliases each ("billion laughs") are 9^9 values built from a
few hundred bytes: a composition that takes minutes and gigabytes, or never ends. Here the
file is composed first (PyYAML's node graph, where a repeat is shared, not copied), the size
it would expand to is counted over that graph, and a file whose aliases multiply it beyond
:data:`MAX_EXPANDED` values (or that nests deeper than :data:`MAX_DEPTH`) is refused in one
line (https://en.wikipedia.org/wiki/Billion_laughs_attack).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpc_ddp.errors import UserError

# Values a file may expand to through its aliases; one without aliases is never refused
# for its size (it expands to itself).
MAX_EXPANDED = 10_000
# Nesting no config needs, well below where OmegaConf's recursive copies exceed Python's
# recursion limit (seen here: a list nested 90 deep in app.x ended in a RecursionError; 80
# passed): files, command-line values and saved overrides alike are refused above it.
MAX_DEPTH = 50
_checked: dict[tuple[str, int, int], None] = {}


def _loader() -> Any:
    # deferred: yaml
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def expanded_size(node: Any) -> tuple[int, int, int]:
    """(values as written, values once every alias is copied, depth) of a composed node
    graph: one visit per distinct node (iterative: no recursion limit); -1 values for an
    alias inside its own anchor."""
    # deferred: yaml
    import yaml

    def children(of: Any) -> list[Any]:
        if isinstance(of, yaml.MappingNode):
            return [n for pair in of.value for n in pair]
        return list(of.value) if isinstance(of, yaml.SequenceNode) else []

    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    started: set[int] = set()
    stack: list[tuple[Any, bool]] = [(node, False)]
    while stack:
        current, done = stack.pop()
        key = id(current)
        if done:
            below = children(current)
            size[key] = 1 + sum(size[id(c)] for c in below)
            depth[key] = 1 + max((depth[id(c)] for c in below), default=0)
            continue
        if key in started:
            if key not in size:  # an alias inside its own anchor: it never ends
                return len(started), -1, 0
            continue
        started.add(key)
        stack.append((current, True))
        stack.extend((c, False) for c in children(current))
    return len(started), size[id(node)], depth[id(node)]


def bracket_depth(text: str) -> int:
    """How deep ``[``, ``{`` and ``(`` nest in an override's text (quoted parts skipped)."""
    depth = deepest = 0
    quote = ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]})":
            depth = max(0, depth - 1)
    return deepest


def check_nesting(override: str, where: str) -> None:
    """UserError for an override (command line, overrides.yaml) whose value nests deeper
    than :data:`MAX_DEPTH`."""
    depth = bracket_depth(override)
    if depth > MAX_DEPTH:
        key = override.partition("=")[0] or "override"
        raise UserError(key, f"{depth} levels", f"nests deeper than {MAX_DEPTH} levels "
                        f"({where}), which no config needs.", "flatten the value.")


def check_text(text: str, where: str) -> None:
    """UserError when ``text`` (from ``where``) would expand beyond the limits."""
    # deferred: yaml
    import yaml

    try:
        documents = list(yaml.compose_all(text, Loader=_loader()))
    except yaml.YAMLError as exc:
        # Refused, not waved through: another loader (Hydra's own, in pure Python) may read
        # what this one cannot (a "%YAML 1.3" directive) and expand its aliases unchecked.
        raise _unparsable(exc, where) from None
    except RecursionError:
        raise UserError(where, "nesting", f"nests too deep to parse (more than {MAX_DEPTH} "
                        "levels, which no config needs).", "flatten the file.") from None
    for document in documents:
        if document is None:
            continue
        written, expanded, depth = expanded_size(document)
        if expanded < 0:
            raise UserError(where, "YAML aliases", "repeat a value inside itself (*name within "
                            "&name), which expands without end.", "remove that alias.")
        if depth > MAX_DEPTH:
            raise UserError(where, f"{depth} levels", f"nests deeper than {MAX_DEPTH} "
                            "levels, which no config needs.", "flatten the file.")
        if expanded > MAX_EXPANDED and expanded > 4 * written:
            raise UserError(where, "YAML aliases", f"expand its {written} values to {expanded}, "
                            f"more than the {MAX_EXPANDED} hpc_ddp builds from a file (an "
                            "alias bomb, or a config that repeats itself a lot).",
                            "write the values out, or repeat fewer of them by alias (*name).")


def load(text: str, where: str) -> Any:
    """``yaml.safe_load`` of ``text`` once :func:`check_text` passed."""
    # deferred: yaml
    import yaml

    check_text(text, where)
    try:
        return yaml.load(text, Loader=_loader())
    except yaml.YAMLError as exc:
        raise _unparsable(exc, where) from None


def _unparsable(exc: Exception, where: str) -> UserError:
    mark = getattr(exc, "problem_mark", None)
    at = f" (line {mark.line + 1})" if mark is not None else ""
    problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
    return UserError(where, "YAML", f"does not parse{at}: {problem}.",
                     "fix the file (YAML 1.1, no %YAML directive of another version).")


def check_folder(folder: Path) -> None:
    """Every YAML file of a user's config folder (each file once per change: its size and
    modification time are remembered)."""
    for root, _, names in os.walk(folder):
        for name in names:
            if not name.endswith((".yaml", ".yml")):
                continue
            path = Path(root) / name
            try:
                info = path.stat()
            except OSError:
                continue
            key = (str(path), info.st_mtime_ns, info.st_size)
            if key in _checked:
                continue
            try:
                text = path.read_text()
            except OSError:
                continue  # Hydra says what is wrong with it, if it reads it at all
            except UnicodeDecodeError:
                raise UserError(str(path), "text", "is not UTF-8 text.",
                                "save it as UTF-8.") from None
            check_text(text, str(path))
            _checked[key] = None
