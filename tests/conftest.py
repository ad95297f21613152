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
