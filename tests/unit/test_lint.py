"""The code stays as STYLE.md asks: ruff and mypy clean, no module over ~400 lines."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

MAX_LINES = 420  # STYLE.md: "no module over ~400 lines"


def _tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, check=False)


def test_ruff() -> None:
    done = _tool("ruff", "check", "hpc_ddp", "tests")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy() -> None:
    done = _tool("mypy", "hpc_ddp")
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_module_is_too_long() -> None:
    long = {str(p.relative_to(REPO)): n for p in sorted((REPO / "hpc_ddp").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules: {long}"
