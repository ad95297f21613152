"""Shared fixtures: run the package's commands as a user would (subprocesses)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def command_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # Tests must not be sent to a Slurm cluster by cluster=auto unless they ask for it.
    env.pop("SLURM_CONF", None)
    env.update(extra or {})
    return env


@pytest.fixture
def hpc_ddp() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``python -m hpc_ddp.<module> args...``; returns the finished process."""

    def run(module: str, args: Sequence[str], timeout: float = 300, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", f"hpc_ddp.{module}", *args],
                              capture_output=True, text=True, timeout=timeout,
                              cwd=cwd or REPO, env=command_env(env), check=False)

    return run


def compose_refusal(overrides: list[str]) -> str:
    """The one-line message compose() refuses ``overrides`` with (fails if it accepts them)."""
    from hpc_ddp.config.compose import compose
    from hpc_ddp.errors import UserError

    with pytest.raises(UserError) as info:
        compose(overrides)
    message = info.value.message
    assert "\n" not in message and "Fix:" in message, message
    return message


# -- what the suite costs, by phase (issue 36: CI reports its own cost) ----------------------

_PHASE_SECONDS: dict[str, float] = {}
_PHASE_TESTS: dict[str, int] = {}
_PHASE_SPAN: dict[str, tuple[float, float]] = {}


def _phase(nodeid: str) -> str:
    """tests/unit/..., tests/integration/..., tests/cluster/..., tests/gpu/...: the folder."""
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    phase = _phase(report.nodeid)
    _PHASE_SECONDS[phase] = _PHASE_SECONDS.get(phase, 0.0) + report.duration
    first, last = _PHASE_SPAN.get(phase, (report.start, report.stop))
    _PHASE_SPAN[phase] = (min(first, report.start), max(last, report.stop))
    if report.when == "call":
        _PHASE_TESTS[phase] = _PHASE_TESTS.get(phase, 0) + 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Seconds per phase (set-up, call and tear-down of its tests, the cluster's start in
    the first cluster test's set-up), and the wall-clock span from its first test's start to
    its last one's end (phases overlap under pytest-xdist: the cluster's tests run on one
    worker while the others run the rest): a change that makes one slower shows here."""
    if not _PHASE_SECONDS:
        return
    terminalreporter.section("time by phase")
    for phase, seconds in sorted(_PHASE_SECONDS.items(), key=lambda kv: -kv[1]):
        first, last = _PHASE_SPAN[phase]
        terminalreporter.write_line(f"{phase:12s} {seconds:8.1f} s in tests, "
                                    f"{last - first:8.1f} s from first start to last end  "
                                    f"({_PHASE_TESTS.get(phase, 0)} tests)")


# -- how the suite spreads over pytest-xdist's workers (scripts/test.sh: -n 2 --dist loadscope)

# Modules whose module-scoped fixture is costly to build (warm rank processes, a trained
# model): their tests stay on one worker, which builds the fixture once.
ONE_WORKER_MODULES = frozenset({
    "tests/integration/test_matrix.py", "tests/integration/test_comm_hooks.py",
    "tests/unit/test_perf_trainer.py",
    "tests/unit/test_scale_cost.py", "tests/unit/test_shards.py",
    "tests/gpu/test_gpu_fast_path.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The docs' benchmarks as documented (tests/cluster/test_doc_benchmarks.py, ~45 minutes)
    run only when asked for by name, ``-m docbench`` (``make bench-docs``): the every-change
    suite deselects them (it runs each benchmark small in its own tests)."""
    if "docbench" in (config.getoption("markexpr", "") or ""):
        return
    benches = [item for item in items if item.get_closest_marker("docbench")]
    if benches:
        config.hook.pytest_deselected(items=benches)
        items[:] = [item for item in items if not item.get_closest_marker("docbench")]


# The niceness of a worker running a test outside tests/cluster while the suite runs on several
# workers (scripts/test.sh: -n 2): the cluster's tests are one chain on one worker, the
# suite's critical path, and use ~1.3 of the 2 cores between their waits; at nice 10 the
# local tests (and the runs they start: children inherit it) take the cores those leave
# (Linux's CFS gives a nice-10 task ~1/9 of a nice-0 one's share when both want a core,
# https://docs.kernel.org/scheduler/sched-design-CFS.html), instead of slowing the chain by
# half (docs/testcluster.md, on the two workers). The cluster's daemons and
# jobs run at slurmd's own priority (Slurm's PropagatePrioProcess=0: a submitter's niceness
# does not reach the job, https://slurm.schedmd.com/slurm.conf.html#OPT_PropagatePrioProcess).
LOCAL_NICE = 10


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    want = 0 if _phase(item.nodeid) == "cluster" else LOCAL_NICE
    if os.getpriority(os.PRIO_PROCESS, 0) != want:
        with contextlib.suppress(PermissionError):  # back to 0 needs root (CAP_SYS_NICE)
            os.setpriority(os.PRIO_PROCESS, 0, want)


def work_unit(nodeid: str) -> str:
    """What xdist hands one worker at a time: every cluster test together (they share the
    one 4-node test cluster and each expects its nodes idle when it starts: one after another
    on one worker), a module of ONE_WORKER_MODULES whole, any other test on its own."""
    path = nodeid.split("::")[0]
    if path.startswith("tests/cluster/"):
        return "tests/cluster"
    return path if path in ONE_WORKER_MODULES else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadscope``: xdist's scheduler over :func:`work_unit`'s units. The
    cluster's unit comes first (tests/cluster is collected first) and keeps its worker for
    the whole cluster phase; the other worker runs the unit and local tests in the cluster
    tests' waits (scheduler cycles, time limits, timeouts), and both share what is left.
    (xdist's own ``loadgroup`` renames node ids, which pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling  # deferred: only under xdist

    class ByUnit(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByUnit(config, log)
