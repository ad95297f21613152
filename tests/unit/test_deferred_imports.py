"""An import inside a function stays only where it keeps a slow module off a path that does
not need it, and says so (docs/architecture.md, "Imports go one way").

For every import inside a function of the package, what it loads that its module does not
load already (through its own top-level imports, followed through the package):
- a slow module: a third-party package (torch, Hydra, submitit, numpy...), one of the
  standard-library modules below that cost more than 10 ms to import here, or our typed
  schemas (0.1 s to build) — the comment names it;
- or, in a module that does not load torch, more of our own modules (the CLI's start and a
  login node's ``status`` stay fast) — the comment names the module it keeps off;
- or it is an optional dependency (inside ``try`` for ImportError) — the comment says so.
Anything else (nothing new, or only our light modules beside torch) belongs at the top of the
module. Milliseconds: the source is parsed, nothing is imported."""

from __future__ import annotations

import ast
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO
from tests.unit.test_import_graph import imports, loaded_with, modules

# Standard-library modules that cost more than 10 ms to import (python -X importtime, here).
SLOW_STDLIB = ("ctypes", "concurrent", "urllib.request", "tarfile", "importlib.metadata")
# Our own modules that are slow to import (the typed schemas build ~100 dataclasses).
SLOW_OURS = ("hpc_ddp.config.schema",)


def external_names(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The non-hpc_ddp modules an import statement names ('torch.distributed', 'numpy')."""
    if isinstance(node, ast.ImportFrom):
        if node.level or (node.module or "").startswith("hpc_ddp"):
            return set()
        return {node.module or ""}
    return {a.name for a in node.names if not a.name.startswith("hpc_ddp")}


def slow(name: str) -> str | None:
    """The slow thing a module name loads, as a comment would name it; None if cheap."""
    root = name.split(".")[0]
    if root in sys.stdlib_module_names:
        return next((s for s in SLOW_STDLIB if name == s or name.startswith(s + ".")), None)
    return root


def top_level_externals(path: Path) -> set[str]:
    """What a module's own body imports from outside the package (not TYPE_CHECKING)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        nodes = [node]
        if isinstance(node, ast.Try | ast.If) and "TYPE_CHECKING" not in ast.unparse(
                getattr(node, "test", ast.Constant(None))):
            nodes = list(ast.walk(node))
        for n in nodes:
            if isinstance(n, ast.Import | ast.ImportFrom):
                found |= external_names(n)
    return found


@dataclass(frozen=True)
class Deferred:
    path: Path
    line: int
    statement: str
    brings: frozenset[str]  # the slow things it loads that the module does not
    ours: frozenset[str]  # our modules it loads that the module does not (None beside torch)
    optional: bool
    commented: bool


@functools.cache
def deferred_imports(root: Path = REPO) -> list[Deferred]:
    known = modules(root)
    every_top = imports(known, top_level_only=True)
    ext = {m: top_level_externals(p) for m, p in known.items()}

    @functools.cache
    def ours_loaded(module: str) -> set[str]:
        return loaded_with(module, every_top) | {module}

    @functools.cache
    def slow_loaded(module: str, itself: bool) -> set[str]:
        mods = loaded_with(module, every_top) | ({module} if itself else set())
        names = {s for m in mods for e in ext[m] if (s := slow(e))}
        return names | {m for m in mods if m in SLOW_OURS}

    found = []
    for module, path in known.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        have = slow_loaded(module, itself=True)
        have_ours = ours_loaded(module)
        optional_nodes = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
                          and any("ImportError" in ast.unparse(h.type or ast.Name("x"))
                                  for h in t.handlers)
                          for b in t.body for n in ast.walk(b)}
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.Import | ast.ImportFrom):
                    continue
                brings = {s for e in external_names(node) if (s := slow(e))} - have
                ours: set[str] = set()
                for target in _internal_targets(node, package, known):
                    if target != module:
                        brings |= slow_loaded(target, itself=True) - have
                        ours |= {target} - have_ours
                if "torch" in have:  # a few ms of ours are nothing beside torch's second
                    ours = set()
                start, end = node.lineno, node.end_lineno or node.lineno
                comment = _comment_of(lines, start, end)
                named = brings or ours
                commented = ("optional" in comment if id(node) in optional_nodes else
                             any(b.rsplit(".", 1)[-1] in comment for b in named))
                found.append(Deferred(path, start, ast.unparse(node), frozenset(brings),
                                      frozenset(ours), id(node) in optional_nodes, commented))
    # a nested function's imports are walked once per enclosing function: keep one
    return sorted(set(found), key=lambda d: (str(d.path), d.line))


def _comment_of(lines: list[str], start: int, end: int) -> str:
    """The comments on an import's own lines, and those right above the run of imports it
    stands in (one comment may speak for a group)."""
    own = [line.split("#", 1)[1] for line in lines[start - 1:end] if "#" in line]
    i = start - 2
    while i >= 0 and (lines[i].lstrip().startswith(("import ", "from ", ")"))
                      or not lines[i].strip() or lines[i].startswith(" " * 8)
                      and lines[i].rstrip().endswith(",")):
        if "#" in lines[i]:  # through the run's other imports, blank lines and wrapped names
            own.append(lines[i].split("#", 1)[1])
        i -= 1
    above = []
    while i >= 0 and lines[i].lstrip().startswith("#"):
        above.append(lines[i].split("#", 1)[1])
        i -= 1
    return "\n".join(own + above)


def _internal_targets(node: ast.Import | ast.ImportFrom, package: str,
                      known: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{up}.{base}" if base else up
        names = [f"{base}.{a.name}" for a in node.names]
    targets = set()
    for name in names:
        if not name.startswith("hpc_ddp"):
            continue
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            targets.add(name)
    return targets


def _where(d: Deferred) -> str:
    return f"{d.path.relative_to(Path.cwd()) if d.path.is_relative_to(Path.cwd()) else d.path}" \
           f":{d.line}: {d.statement}"


def test_every_deferred_import_keeps_a_slow_module_off_a_path() -> None:
    pointless = [_where(d) for d in deferred_imports()
                 if not d.brings and not d.ours and not d.optional]
    assert not pointless, ("these imports load nothing slow that their module does not load "
                           "already: import them at the top of the module:\n"
                           + "\n".join(pointless))


def test_every_deferred_import_says_what_it_keeps_off() -> None:
    silent = [f"{_where(d)}  (say: {', '.join(sorted(d.brings or d.ours)) or 'optional'})"
              for d in deferred_imports() if not d.commented]
    assert not silent, ("an import inside a function needs a comment (its line or the one "
                        "above) naming the slow module it keeps off the module's import:\n"
                        + "\n".join(silent))


def test_the_checker_sees_a_pointless_and_a_silent_import(tmp_path: Path) -> None:
    package = tmp_path / "hpc_ddp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "heavy.py").write_text("import torch\n\n\ndef f():\n    import torch\n")
    (package / "light.py").write_text(
        "def said():\n    import numpy  # deferred: numpy\n\n\n"
        "def silent():\n    import torch\n\n\n"
        "def ours():\n    # deferred: torch\n    from hpc_ddp import heavy\n\n\n"
        "def unnamed():\n    from hpc_ddp import plain  # deferred (start-up)\n")
    (package / "plain.py").write_text("import json\n")
    found = {(d.path.name, d.line): d for d in deferred_imports(tmp_path)}
    assert not found["heavy.py", 5].brings and not found["heavy.py", 5].ours  # pointless
    assert found["light.py", 2].commented and found["light.py", 2].brings == {"numpy"}
    assert not found["light.py", 6].commented and found["light.py", 6].brings == {"torch"}
    assert found["light.py", 11].commented and found["light.py", 11].brings == {"torch"}
    plain = found["light.py", 15]  # our own light module only: it must be named
    assert plain.ours == {"hpc_ddp.plain"} and not plain.brings and not plain.commented
    assert slow("concurrent.futures") == "concurrent" and slow("importlib.util") is None
