"""environment.yml (conda) and pyproject.toml (pip) pin the same versions."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _pins(requirements: list[str]) -> dict[str, str]:
    pins = {}
    for req in requirements:
        name, sep, version = req.partition("==")
        assert sep, f"{req!r} is not pinned with =="
        pins[name.strip().lower()] = version.strip()
    return pins


def test_conda_environment_matches_pyproject() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert _pins(pip_section) == _pins(project["dependencies"])
    assert "python=3.11" in env["dependencies"]


def test_the_optional_trackers_are_pinned_alike() -> None:
    """The extras a logger= needs are pinned in pyproject.toml, and environment.yml names
    the same versions (commented: optional)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    commented = [line.split("#", 2)[1].strip().lstrip("- ").split()[0]
                 for line in (REPO / "environment.yml").read_text().splitlines()
                 if line.strip().startswith("# - ")]
    for extra in ("wandb", "mlflow", "sweep"):
        assert _pins(extras[extra]).items() <= _pins(commented).items(), extra
        assert _pins(extras[extra]).items() <= _pins(extras["test"]).items(), extra


def test_the_cli_module_does_not_shadow_the_api_function(tmp_path: Path) -> None:
    import hpc_ddp
    import hpc_ddp.submit  # noqa: F401  (sets the package attribute to the module)
    from hpc_ddp.errors import UserError

    with pytest.raises(UserError, match="nodes=0"):
        hpc_ddp.submit(["nodes=0", f"run_dir={tmp_path / 'r'}"])
