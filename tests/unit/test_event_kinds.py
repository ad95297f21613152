"""events.jsonl (hpc_ddp/events.py): in a sweep, each point's node-loss driver reads and
writes the point's own history (issue 46); every kind written is one of events.py's
constants."""

from __future__ import annotations

import ast
import shlex
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp import events
from hpc_ddp.slurm import driver
from hpc_ddp.sweep.arrays import arrays
from hpc_ddp.sweep.launch import plan_points
from tests.conftest import REPO

NO_SLURM = {"PATH": "/nonexistent"}


def _driver_argv(setup: list[str]) -> list[str]:
    """The driver's own arguments, from the batch script's srun() function line."""
    line = next(s for s in setup if "-m hpc_ddp.slurm.driver" in s)
    words = shlex.split(line.split("; then ", 1)[1].split(' -- "$@"', 1)[0])
    return words[words.index("hpc_ddp.slurm.driver") + 1:]


def test_a_sweep_points_driver_acts_on_the_points_own_events(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _, plans = plan_points(["cluster=slurm", "nodes=2", "optim.lr=0.1,0.2,0.3",
                                    "sweep.max_array_size=10", f"sweep.dir={tmp_path / 's'}"],
                                   tmp_path, NO_SLURM)
    [(indices, executor)] = list(arrays(plans, folder, NO_SLURM))
    assert indices == [0, 1, 2]
    argv = _driver_argv(executor.parameters["setup"])
    # Array task 1 is point 1: its ranks left a lost supervisor to the driver (deferred).
    point = plans[1].run_dir.root
    point.mkdir(parents=True)
    events.append(point, {"kind": events.FAILURE, "job": "77", "deferred": True})
    codes = iter([1, 0])
    monkeypatch.setattr(driver, "run_step", lambda *a, **k: next(codes))
    monkeypatch.setattr(driver, "job_nodes", lambda job, env: ["n1", "n2"])
    monkeypatch.setattr(driver.signal, "signal", lambda *a: None)
    for name, value in (("SLURM_JOB_ID", "77"), ("SLURM_JOB_NODELIST", "n[1-2]"),
                        ("SLURMD_NODENAME", "n1"), ("SLURM_ARRAY_JOB_ID", "70"),
                        ("SLURM_ARRAY_TASK_ID", "1")):
        monkeypatch.setenv(name, value)
    assert driver.main([*argv, "--", "true"]) == 0  # started again, then done
    kinds = [e["kind"] for e in events.read(point)]
    assert kinds == [events.FAILURE, events.RESTART_IN_PLACE]
    assert not (folder / events.FILE).exists()
    assert all(not events.read(p.run_dir.root) for p in (plans[0], plans[2]))


# -- every kind written is a constant of events.py --------------------------------------------



def _kind_names() -> set[str]:
    return {name for name in dir(events) if name.isupper()
            and isinstance(value := getattr(events, name), str) and value in events.KINDS}


def _is_constant(node: ast.AST, names: set[str]) -> bool:
    """``events.STOP`` or a name imported from it (``STOP``)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id == "events" and node.attr in names
    return isinstance(node, ast.Name) and node.id in names


def _written(tree: ast.Module) -> list[tuple[int, ast.AST | None]]:
    """(line, the kind's node) of every event written: the second argument of
    ``events.append`` (or of the driver's ``_note``), a dict or what a function of the same
    module that builds it returns."""
    functions = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    # The driver's wrapper passes its callers' events on (each of those is checked).
    relayed = {id(n) for n in ast.walk(functions["_note"])} if "_note" in functions else set()
    found: list[tuple[int, ast.AST | None]] = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and id(n) not in relayed):
        f = call.func
        appends = (isinstance(f, ast.Attribute) and f.attr == "append"
                   and isinstance(f.value, ast.Name) and f.value.id == "events") or (
            isinstance(f, ast.Name) and f.id == "_note")
        if not appends or len(call.args) < 2:
            continue
        made: list[ast.AST] = [call.args[1]]
        if isinstance(call.args[1], ast.Call) and isinstance(call.args[1].func, ast.Name):
            built = functions.get(call.args[1].func.id)
            made = [r.value for r in ast.walk(built) if isinstance(r, ast.Return)
                    and r.value is not None] if built else made
        for event in made:
            kind = None
            if isinstance(event, ast.Dict):
                kind = next((v for k, v in zip(event.keys, event.values, strict=True)
                             if isinstance(k, ast.Constant) and k.value == "kind"), None)
            found.append((call.lineno, kind))
    return found


def _compared(tree: ast.Module) -> list[tuple[int, str]]:
    """Bare strings an event's kind is compared with (``e.get("kind") == "stop"``)."""
    found = []
    for node in (n for n in ast.walk(tree) if isinstance(n, ast.Compare)):
        left = node.left
        if not (isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute)
                and left.func.attr == "get" and left.args
                and isinstance(left.args[0], ast.Constant) and left.args[0].value == "kind"):
            continue
        for right in node.comparators:
            items = right.elts if isinstance(right, ast.Tuple | ast.List | ast.Set) else [right]
            found += [(node.lineno, i.value) for i in items if isinstance(i, ast.Constant)
                      and isinstance(i.value, str) and i.value in events.KINDS]
    return found


def test_every_event_written_or_read_names_its_kind_by_a_constant() -> None:
    names = _kind_names()
    assert {events.FAILURE, events.STOP, events.REQUEUE, events.RESTART_IN_PLACE,
            events.SHRINK, events.RECOVERED} <= events.KINDS
    bad: list[str] = []
    writers = 0
    for path in sorted((REPO / "hpc_ddp").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text())
        for line, kind in _written(tree):
            writers += 1
            if kind is None or not _is_constant(kind, names):
                bad.append(f"{rel}:{line}: an event whose kind is not an events.py constant")
        bad += [f"{rel}:{line}: kind compared with the bare string {value!r}"
                for line, value in _compared(tree)]
    assert writers >= 14  # the driver's five, the checkpoint fallback, the recovered step,
    # the supervisors' stops, failures, requeues and restarts in place
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_bare_kind() -> None:
    tree = ast.parse("events.append(root, {'kind': 'stop'})\n"
                     "events.append(root, {'kind': events.STOP})\n"
                     "x = e.get('kind') in ('failure', 'other')\n")
    found: list[Any] = _written(tree)
    assert [_is_constant(k, _kind_names()) for _, k in found] == [False, True]
    assert _compared(tree) == [(3, "failure")]
