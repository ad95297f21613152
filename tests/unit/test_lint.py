"""The code stays as docs/architecture.md asks: ruff and mypy clean, no module over ~400
lines, imports one way."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO

MAX_LINES = 420  # docs/architecture.md: "no module over ~400 lines"


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


# A reader of the project has the repository only: comments and docs cite a page of docs/ or
# an upstream link, never notes kept outside it (the pattern does not match its own text).
OUTSIDE = re.compile(r"\b(FIELD|STYLE|TESTCLUSTER)\.md\b|/work/(shared|main)\b")
CITING = ("hpc_ddp", "tests", "docs", "conf", "jobs", "scripts", "examples", ".ci")


def test_nothing_cites_files_outside_the_repository() -> None:
    files = [REPO / "README.md", REPO / "Makefile", REPO / "pyproject.toml",
             *(p for top in CITING for p in sorted((REPO / top).rglob("*"))
               if p.is_file() and p.suffix in ("", ".py", ".md", ".yaml", ".sh", ".sbatch",
                                               ".ipynb", ".toml"))]
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if OUTSIDE.search(line)]
    assert not found, "cite docs/ or an upstream link instead:\n" + "\n".join(found)
