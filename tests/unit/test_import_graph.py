"""Imports go one way (docs/architecture.md): the graph of every module of the package,
top-level modules and imports inside functions included, has no cycle and no arrow from a
layer to one above it. Milliseconds: the source is parsed, nothing is imported."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO

# Lowest first. A module may import its own layer's modules and those of the layers below.
# A module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, ...]] = [
    ("hpc_ddp.redact", "hpc_ddp.errors", "hpc_ddp.hostlist", "hpc_ddp.procs", "hpc_ddp.rundir",
     "hpc_ddp.events", "hpc_ddp.owned", "hpc_ddp.ranklines", "hpc_ddp.version",
     "hpc_ddp.sockets"),
    # A sweep's expansion is the config's grammar: a remote sweep checks its first point.
    # An adaptive sweep's study (its space, sampler, storage) is read by the trial's rank 0
    # too, which reports its evaluations to it (rank/services/pruning.py).
    ("hpc_ddp.config", "hpc_ddp.sweep.expand", "hpc_ddp.sweep.space",
     "hpc_ddp.sweep.study_parts", "hpc_ddp.sweep.search_file", "hpc_ddp.sweep.study"),
    ("hpc_ddp.targets",),
    # The rank side: what runs on every rank.
    ("hpc_ddp.rank.contract",),
    ("hpc_ddp.slurm",),  # what hpc_ddp asks of Slurm, from the submit host and from a rank
    ("hpc_ddp.rank.services",),
    ("hpc_ddp.rank.join",),
    # Warm starts: a rank process forked from its node's warm process (a task, a supervisor).
    ("hpc_ddp.rank.warm",),
    ("hpc_ddp.data",),
    ("hpc_ddp.rank.context",),
    ("hpc_ddp.trainer",),
    ("hpc_ddp.rank.supervise",),
    ("hpc_ddp.rank.main", "hpc_ddp.rank"),
    # A run's inputs, checked on the submit host and again by every task of an sbatch job.
    ("hpc_ddp.inputs",),
    ("hpc_ddp.train",),
    # The submit side: what runs where `submit` is typed.
    # A Slurm job's end told from the run's records: the job control (launch/control.py)
    # asks it as status does.
    ("hpc_ddp.launch", "hpc_ddp.watch.ended"),
    # After submission (watch/): a run's cost and failures, followed; status, logs, stop.
    ("hpc_ddp.watch", "hpc_ddp.watch.runcost", "hpc_ddp.watch.recovery_lines"),
    ("hpc_ddp.watch.follow", "hpc_ddp.watch.failures"),
    # The config pipeline: one run's or a sweep's plan (compose, resolve, secrets, checks).
    ("hpc_ddp.planning",),
    ("hpc_ddp.api", "hpc_ddp.datacheck", "hpc_ddp.checkpoint"),
    ("hpc_ddp.doctor",),
    ("hpc_ddp.remote",),  # a cluster reached over SSH: status and logs forward through it
    ("hpc_ddp.sweep", "hpc_ddp.watch.status", "hpc_ddp.watch.logs", "hpc_ddp.watch.stoprun",
     "hpc_ddp.collect"),
    # The commands.
    ("hpc_ddp.submit", "hpc_ddp.env", "hpc_ddp.status", "hpc_ddp.logs"),
    # The public names (lazy: they import nothing until asked), then what uses them as a
    # user's program would.
    ("hpc_ddp",),
    ("hpc_ddp.bench", "hpc_ddp.testcluster"),
    ("hpc_ddp.__main__",),
]


def modules(root: Path = REPO) -> dict[str, Path]:
    found = {}
    for path in sorted((root / "hpc_ddp").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(known: dict[str, Path], top_level_only: bool = False) -> dict[str, set[str]]:
    """module -> the hpc_ddp modules it imports anywhere in its source (not under
    TYPE_CHECKING: those are for the type checker only and never run); ``top_level_only``:
    those imported when the module itself is (its body's imports, and its packages)."""

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        if top_level_only:
            parts = module.split(".")
            graph[module] |= {p for i in range(1, len(parts))
                              if (p := ".".join(parts[:i])) in known}
        for node in (tree.body if top_level_only else ast.walk(tree)):
            if id(node) in typing_only:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{base}" if base else up
                names = [f"{base}.{a.name}" for a in node.names]
            for name in names:
                target = resolve(name) if name.startswith("hpc_ddp") else None
                if target and target != module:
                    graph[module].add(target)
    return graph


def layer_of(module: str) -> int:
    best, layer = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            # The package itself ("hpc_ddp") is its __init__ alone, not a prefix of all.
            within = module.startswith(prefix + ".") and prefix != "hpc_ddp"
            if (module == prefix or within) and len(prefix) > best:
                best, layer = len(prefix), index
    return layer


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    missing = [m for m in modules() if layer_of(m) < 0]
    assert not missing, f"add these to LAYERS (and to docs/architecture.md): {missing}"


def test_the_import_graph_has_no_cycle() -> None:
    found = cycles(imports(modules()))
    assert not found, "import cycles (a deferred import hides one too):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_no_module_imports_a_layer_above_its_own() -> None:
    graph = imports(modules())
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if layer_of(t) > layer_of(m))
    assert not upward, "imports that point up (docs/architecture.md):\n" + "\n".join(upward)


def loaded_with(module: str, top: dict[str, set[str]]) -> set[str]:
    """Every hpc_ddp module that importing ``module`` loads."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for m in top.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_no_import_is_deferred_for_nothing() -> None:
    """An import inside a function keeps the modules it loads off the importer's path (a
    CLI's start, a login node's status); one of a module the importer loads anyway only
    hides a dependency."""
    known = modules()
    every, top = imports(known), imports(known, top_level_only=True)
    pointless = sorted(f"{m} -> {t}" for m, targets in every.items()
                       for t in targets - top.get(m, set()) if t in loaded_with(m, top))
    assert not pointless, "import these at the top of the module:\n" + "\n".join(pointless)


def test_the_checker_sees_a_cycle_and_an_upward_arrow() -> None:
    graph = {"hpc_ddp.rank.join.a": {"hpc_ddp.rank.join.b"},
             "hpc_ddp.rank.join.b": {"hpc_ddp.rank.join.a", "hpc_ddp.launch.slurm"}}
    assert cycles(graph) == [["hpc_ddp.rank.join.a", "hpc_ddp.rank.join.b"]]
    assert layer_of("hpc_ddp.launch.slurm") > layer_of("hpc_ddp.rank.join.b")
    assert layer_of("hpc_ddp.newthing") == -1  # a new top-level module must be placed
