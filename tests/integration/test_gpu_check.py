"""The GPU check runs first time on the lent machine's bare image: its bootstrap is proven
here on Python 3.12 with only the carried wheels, and its commands on CPU (`--cpu`), so that
only CUDA itself is left for the device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, command_env

PYTHON_312 = Path(os.environ.get("PYENV_ROOT", "/root/.pyenv")) / "versions" / "3.12.1" / (
    "bin/python")


def test_the_check_runs_its_commands_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    before = set(os.listdir(REPO / "outputs")) if (REPO / "outputs").is_dir() else set()
    # As on the device: no Slurm answering, so `make run` stays on this machine.
    env = command_env({"OUT": str(out), "PYTHON": sys.executable})
    # Longer than the sum of its steps' own timeouts (with --cpu: 10x the device's, 1,500 s):
    # a step that hangs is named in the summary, not cut off here.
    done = subprocess.run([str(REPO / "scripts" / "gpu_check.sh"), "--cpu"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text()
    for line in ("torch 2.", "make run: exit 0", "make run: 2 rank on cpu, 64 steps",
                 "resume: stopped at step", "ended at 240 on cpu: met",
                 "function entry: backend gloo, RANK=0, WORLD_SIZE=1",
                 "script= ", "gpu_check done: exit 0"):
        assert line in summary, summary
    assert len(list(out.iterdir())) <= 8
    after = set(os.listdir(REPO / "outputs")) if (REPO / "outputs").is_dir() else set()
    assert after == before  # `make run`'s folder is the check's own and is removed


def test_the_bootstrap_on_python_312_with_only_the_carried_wheels(tmp_path: Path) -> None:
    if not PYTHON_312.is_file():
        message = f"no Python 3.12 at {PYTHON_312} (pyenv install 3.12.1)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    venv = tmp_path / "venv"
    subprocess.run([str(PYTHON_312), "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # What the device image has that matters here (its torch is left out: nothing imports
    # torch before a job runs, which is what this proves too).
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "PyYAML==6.0.4", "packaging",
                    "typing_extensions"], check=True, timeout=300)
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    made = subprocess.run([str(REPO / "scripts" / "gpu_wheels.sh")], cwd=REPO,
                          env={**os.environ, "GPU_WHEELS": str(wheels)}, capture_output=True,
                          text=True, timeout=300, check=False)
    assert made.returncode == 0, made.stdout + made.stderr
    assert len(list(wheels.glob("*.whl"))) == 6
    boot = subprocess.run([str(REPO / "scripts" / "gpu_bootstrap.sh")], cwd=REPO,
                          env={**os.environ, "GPU_WHEELS": str(wheels), "GPU_SITE": str(site),
                               "PYTHON": str(py)}, capture_output=True, text=True,
                          timeout=300, check=False)
    assert boot.returncode == 0, boot.stdout + boot.stderr
    assert "bootstrap: 3.12" in boot.stderr and f"HPC_DDP_PYTHON={py}" in boot.stdout
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SLURM_CONF")}
    env["PYTHONPATH"] = f"{site}:{REPO}"
    dry = subprocess.run([str(py), "-m", "hpc_ddp.submit", "cluster=slurm", "nodes=2",
                          "dry_run=true", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120, check=False)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    task = f"{py} -m hpc_ddp.rank.main.submitted -u -m submitit"  # launch/slurm.py
    assert "#SBATCH --nodes=2" in dry.stdout and task in dry.stdout
    cfg = subprocess.run([str(py), "-m", "hpc_ddp.submit", "--cfg", "cluster=slurm",
                          "model=torchvision"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert cfg.returncode == 0 and "_target_: hpc_ddp.trainer.models.torchvision_model" in (
        cfg.stdout), cfg.stderr
