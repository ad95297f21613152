"""Shared fixtures: run the package's commands as a user would (subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

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


def _phase(nodeid: str) -> str:
    """tests/unit/..., tests/integration/..., tests/cluster/..., tests/gpu/...: the folder."""
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    phase = _phase(report.nodeid)
    _PHASE_SECONDS[phase] = _PHASE_SECONDS.get(phase, 0.0) + report.duration
    if report.when == "call":
        _PHASE_TESTS[phase] = _PHASE_TESTS.get(phase, 0) + 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Seconds per phase (set-up, call and tear-down of its tests, the cluster's start in
    the first cluster test's set-up): a change that makes one slower shows here."""
    if not _PHASE_SECONDS:
        return
    terminalreporter.section("time by phase")
    for phase, seconds in sorted(_PHASE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{phase:12s} {seconds:8.1f} s  "
                                    f"({_PHASE_TESTS.get(phase, 0)} tests)")
