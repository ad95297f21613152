"""python -m hpc_ddp.env venv for real: a venv made and updated, its project importable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_env_command_builds_and_updates_a_venv_offline(tmp_path: Path) -> None:
    """python -m hpc_ddp.env venv for real (python -m venv, pip install --editable, pip
    check), on a project that needs nothing from an index: its build backend is in-tree."""
    project = tmp_path / "tinyproj"
    (project / "tinyproj").mkdir(parents=True)
    (project / "tinyproj" / "__init__.py").write_text("VALUE = 42\n")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        '[project]\nname = "tinyproj"\nversion = "0.3"\ndependencies = []\n')
    (project / "backend.py").write_text(BACKEND)
    venv = tmp_path / "venv"
    env = {**os.environ, "PIP_NO_INDEX": "1"}  # no package index: nothing is downloaded
    first = subprocess.run([sys.executable, "-m", "hpc_ddp.env", "venv", str(venv),
                            "--project", str(project)], env=env, capture_output=True,
                           text=True, timeout=300, check=False)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "[1/3] create the venv" in first.stdout and "[3/3] done" in first.stdout
    assert first.stdout.rstrip().splitlines()[-1].startswith(f"use it on every node with: "
                                                             f"cluster.venv={venv}")
    imported = subprocess.run([str(venv / "bin" / "python"), "-c",
                               "import tinyproj; print(tinyproj.VALUE)"], capture_output=True,
                              text=True, check=False)
    assert imported.stdout == "42\n"
    again = subprocess.run([sys.executable, "-m", "hpc_ddp.env", "venv", str(venv),
                            "--project", str(project)], env=env, capture_output=True,
                           text=True, timeout=300, check=False)
    assert again.returncode == 0 and "[1/2] install tinyproj" in again.stdout  # an update


# A PEP 517/660 build backend needing nothing installed: an editable wheel is a .pth file.
BACKEND = '''
import base64, hashlib, os, zipfile

NAME, VERSION = "tinyproj", "0.3"
DIST = f"{NAME}-{VERSION}.dist-info"


def _wheel(directory, files):
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(os.path.join(directory, name), "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest())
            records.append(f"{path},sha256={digest.rstrip(b'=').decode()},{len(text)}")
        whl.writestr(f"{DIST}/RECORD", "\\n".join([*records, f"{DIST}/RECORD,,"]) + "\\n")
    return name


def _meta():
    return {f"{DIST}/METADATA": f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: {VERSION}\\n",
            f"{DIST}/WHEEL": "Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\n"
                             "Tag: py3-none-any\\n"}


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    here = os.path.dirname(os.path.abspath(__file__))
    return _wheel(wheel_directory, {**_meta(), f"{NAME}.pth": here + "\\n"})


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return build_editable(wheel_directory)
'''
