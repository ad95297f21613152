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
# Cluster modules' seconds and each chain's span (by xdist worker): CLUSTER_MODULE_SECONDS'
# figures come from here.
_MODULE_SECONDS: dict[str, float] = {}
_CHAIN_SPAN: dict[str, tuple[float, float]] = {}
# The other phases' modules (integration, unit): where the suite's time goes, for cuts.
_LOCAL_MODULE_SECONDS: dict[str, float] = {}
# Each work unit's (first start, last end) on the clock: what the suite's last minutes ran
# (LOCAL_UNIT_SECONDS' order comes from here).
_UNIT_SPAN: dict[str, tuple[float, float]] = {}


def _phase(nodeid: str) -> str:
    """tests/unit/..., tests/integration/..., tests/cluster/..., tests/gpu/...: the folder."""
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    phase = _phase(report.nodeid)
    _PHASE_SECONDS[phase] = _PHASE_SECONDS.get(phase, 0.0) + report.duration
    if report.start > 0:  # a crashed worker's report has no times
        first, last = _PHASE_SPAN.get(phase, (report.start, report.stop))
        _PHASE_SPAN[phase] = (min(first, report.start), max(last, report.stop))
    if report.when == "call":
        _PHASE_TESTS[phase] = _PHASE_TESTS.get(phase, 0) + 1
    if report.start > 0:
        unit = work_unit(report.nodeid)
        first, last = _UNIT_SPAN.get(unit, (report.start, report.stop))
        _UNIT_SPAN[unit] = (min(first, report.start), max(last, report.stop))
    if phase in ("integration", "unit"):
        module = report.nodeid.split("::")[0].removeprefix("tests/")
        _LOCAL_MODULE_SECONDS[module] = _LOCAL_MODULE_SECONDS.get(module, 0.0) + report.duration
    if phase == "cluster":
        module = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
        _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration
        worker = getattr(getattr(report, "node", None), "gateway", None)
        chain = getattr(worker, "id", "main")
        first, last = _CHAIN_SPAN.get(chain, (report.start, report.stop))
        _CHAIN_SPAN[chain] = (min(first, report.start), max(last, report.stop))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Seconds per phase (set-up, call and tear-down of its tests, the cluster's start in
    the first cluster test's set-up), and the wall-clock span from its first test's start to
    its last one's end (phases overlap under pytest-xdist: the cluster's tests run on one
    worker while the others run the rest): a change that makes one slower shows here."""
    if not _PHASE_SECONDS:
        return
    terminalreporter.section("time by phase")
    for phase, seconds in sorted(_PHASE_SECONDS.items(), key=lambda kv: -kv[1]):
        first, last = _PHASE_SPAN.get(phase, (0.0, 0.0))
        terminalreporter.write_line(f"{phase:12s} {seconds:8.1f} s in tests, "
                                    f"{last - first:8.1f} s from first start to last end  "
                                    f"({_PHASE_TESTS.get(phase, 0)} tests)")
    if _CHAIN_SPAN:
        terminalreporter.write_line("cluster chains: " + ", ".join(
            f"{chain} {last - first:.0f} s" for chain, (first, last) in sorted(
                _CHAIN_SPAN.items())) + "; by module: " + ", ".join(
            f"{module.removeprefix('test_').removesuffix('.py')} {seconds:.0f}"
            for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])))
    if _LOCAL_MODULE_SECONDS:
        slowest = sorted(_LOCAL_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:15]
        terminalreporter.write_line("slowest other modules: " + ", ".join(
            f"{module.removesuffix('.py')} {seconds:.0f}" for module, seconds in slowest))
    if _UNIT_SPAN:
        began = min(first for first, _ in _UNIT_SPAN.values())
        last = sorted(_UNIT_SPAN.items(), key=lambda kv: -kv[1][1])[:8]
        terminalreporter.write_line("the last to end (start-end, s into the tests): " + ", ".join(
            f"{unit.removeprefix('tests/')} {first - began:.0f}-{end - began:.0f}"
            for unit, (first, end) in last))


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
# Where the kernel groups by session (autogroup, https://man7.org/linux/man-pages/man7/sched.7.html)
# it orders only this session's processes: a local run's ranks (their kept warm process's
# session) and Slurm's tasks share the cores evenly (measured: docs/testcluster.md).
LOCAL_NICE = 10


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    want = 0 if _phase(item.nodeid) == "cluster" else LOCAL_NICE
    if os.getpriority(os.PRIO_PROCESS, 0) != want:
        with contextlib.suppress(PermissionError):  # back to 0 needs root (CAP_SYS_NICE)
            os.setpriority(os.PRIO_PROCESS, 0, want)


# The cluster's tests run as two chains, one per test cluster (hpc_ddp.testcluster's instances
# 0 and 1, side by side on this machine), on workers gw0 and gw1; the other workers run the
# unit and local tests, and a chain's worker joins them when no cluster module is left
# (scripts/test.sh starts four). HPC_DDP_TEST_CLUSTERS=1: one chain, as before.
CLUSTERS_ENV = "HPC_DDP_TEST_CLUSTERS"
# Seconds per cluster module in CI (its tests' set-up, call and tear-down; the suite prints
# them at the end, "cluster chains"): the longest is handed out first, so that the two chains
# end close together (longest-processing-time first). A module not listed counts 60 s.
CLUSTER_MODULE_SECONDS = {  # CI of 2026-12-07, two chains
    "test_fault_tolerance.py": 662, "test_your_code.py": 389, "test_shrink.py": 372,
    "test_sharded.py": 318, "test_remote.py": 274, "test_adaptive_sweep.py": 263,
    "test_slurm_submit.py": 254, "test_docs.py": 190, "test_layouts.py": 177,
    "test_scaling_report.py": 111, "test_containers.py": 109, "test_staging.py": 81,
    "test_sweeps.py": 76, "test_observability.py": 71, "test_node_software.py": 67,
    "test_no_accounting.py": 62, "test_gpus.py": 54, "test_checkpoints_and_secrets.py": 54,
    "test_failure_story.py": 44, "test_run_reports.py": 44, "test_cpu_binding.py": 44,
    "test_sweep_scale.py": 33, "test_doctor.py": 25, "test_testcluster.py": 17,
    "test_bench_comm.py": 16, "test_pending_reasons.py": 4, "test_early_signals.py": 25,
}

# The other units that take longest (CI of 2026-12-07: the test-seconds of each, under the
# chains' load), handed out first: in the queue's order the combination matrix (one unit, its
# rows one after another) came after ~1,100 test-s of other local tests, and could end the
# suite alone; the search benchmark's trials mostly sleep, and overlap the other work. The
# summary's "the last to end" shows what a schedule left for the end.
LOCAL_UNIT_SECONDS = {
    "tests/integration/test_matrix.py": 970.0,
    "tests/integration/test_adaptive_sweep.py::"
    "test_bench_search_compares_batches_asynchrony_and_pruning": 340.0,
    "tests/integration/test_gpu_check.py::test_the_check_runs_its_commands_on_cpu": 66.0,
    "tests/unit/test_perf_trainer.py": 60.0,
    "tests/integration/test_docs.py::test_local_blocks_do_what_the_page_shows[docs/quickstart.md]":
        58.0,
    "tests/integration/test_docs.py::test_local_blocks_do_what_the_page_shows[README.md]": 55.0,
    "tests/integration/test_comm_hooks.py": 51.0,
}

# Modules that must run on one cluster: docs/testcluster.md's blocks (tests/cluster/test_docs.py)
# run `python -m hpc_ddp.testcluster shape` and `straggle` as a reader would, on the default
# cluster, by its node names.
CLUSTER_PINNED = {"tests/cluster/test_docs.py": 0}


def work_unit(nodeid: str) -> str:
    """What xdist hands one worker at a time: a cluster module whole (its tests expect the
    cluster's nodes idle when they start: one after another on one cluster, and its
    module-scoped runs are built once), a module of ONE_WORKER_MODULES whole, any other test
    on its own."""
    path = nodeid.split("::")[0]
    if path.startswith("tests/cluster/") or path in ONE_WORKER_MODULES:
        return path
    return nodeid


def cluster_seconds(unit: str) -> float:
    """The expected cost of a cluster module (CLUSTER_MODULE_SECONDS), -1 for other units."""
    if not unit.startswith("tests/cluster/"):
        return -1.0
    return float(CLUSTER_MODULE_SECONDS.get(unit.rsplit("/", 1)[-1], 60))


def cluster_chains(workers: int, environ: dict[str, str] | None = None) -> int:
    """How many workers run cluster modules: HPC_DDP_TEST_CLUSTERS (default 2), leaving at
    least one worker for the other tests when there are two or more."""
    wanted = int((environ if environ is not None else os.environ).get(CLUSTERS_ENV) or 2)
    return max(1, min(wanted, workers - 1 if workers > 1 else 1))


def cluster_instance(worker: str | None) -> int:
    """The test cluster a worker's cluster tests use: gw0 (or no xdist) 0, gw1 1."""
    return int(worker[2:]) if worker and worker.startswith("gw") else 0


def next_unit(units: list[str], instance: int, chains: int) -> str | None:
    """The unit the worker of ``instance`` (:func:`cluster_instance`) takes next from
    ``units`` (the queue's order): a chain's worker (instance < chains) the costliest cluster
    module it may run (CLUSTER_PINNED), or else the costliest other unit; any other worker
    the costliest unit that is not a cluster module (LOCAL_UNIT_SECONDS; the first in the
    queue's order among those it does not list; None: nothing for it)."""
    cluster = [u for u in units if cluster_seconds(u) >= 0
               and CLUSTER_PINNED.get(u, instance) == instance]
    if instance < chains and cluster:
        return max(cluster, key=cluster_seconds)
    others = [u for u in units if cluster_seconds(u) < 0]
    return max(others, key=lambda u: LOCAL_UNIT_SECONDS.get(u, 0.0), default=None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadscope``: xdist's scheduler over :func:`work_unit`'s units, where
    workers gw0 and gw1 (:func:`cluster_chains`) each run a chain of cluster modules on their
    own test cluster and the others never take one; every worker takes the other units in
    the chains' waits (scheduler cycles, time limits, timeouts) and after them.
    (xdist's own ``loadgroup`` renames node ids, which pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling  # deferred: only under xdist

    chains = cluster_chains(int(config.getvalue("numprocesses") or 1))

    class ByUnit(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _unit_for(self, node: Any) -> str | None:
            return next_unit(list(self.workqueue), cluster_instance(node.gateway.id), chains)

        def _assign_work_unit(self, node: Any) -> None:
            unit = self._unit_for(node)
            assigned = self.assigned_work.setdefault(node, {})
            if unit is None:
                return
            work = self.workqueue.pop(unit)
            assigned[unit] = work
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid)
                                    for nodeid, done in work.items() if not done])

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if self._unit_for(node) is None:  # nothing left that this worker may take
                node.shutdown()
                return
            if self._pending_of(self.assigned_work.setdefault(node, {})) > 2:
                return
            self._assign_work_unit(node)

    return ByUnit(config, log)
