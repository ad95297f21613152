"""A cluster whose accounting cannot be read (docs/slurm.md#without-accounting): every command
that waits ends, with the state Slurm gave, and says once why it could not ask sacct.

The test cluster's clients get a copy of its slurm.conf with
``AccountingStorageType=accounting_storage/none`` (Slurm's default): sacct answers "Slurm
accounting storage is disabled", as on a small cluster without slurmdbd; the controller and
its jobs are the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]
SMALL = ["data.train_size=512", "data.eval_size=128", "trainer.log_interval=5",
         "trainer.max_steps=6", "nodes=1"]
NOTE = "Slurm accounting cannot be read here"


@pytest.fixture
def no_accounting(slurm_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    conf = Path(slurm_env["SLURM_CONF"]).read_text().splitlines()
    lines = [ln for ln in conf if not ln.startswith("AccountingStorageType=")]
    path = tmp_path / "slurm.conf"
    path.write_text("\n".join([*lines, "AccountingStorageType=accounting_storage/none"]) + "\n")
    env = {**slurm_env, "SLURM_CONF": str(path)}
    said = subprocess.run(["sacct", "-X", "-n"], env=env, capture_output=True, text=True,
                          check=False)
    assert said.returncode != 0 and "accounting storage is disabled" in said.stderr, said
    return env


def test_without_accounting_every_waiting_command_ends(
        hpc_ddp: Run, no_accounting: dict[str, str], tmp_path: Path) -> None:
    env = no_accounting
    run = tmp_path / "run"
    started = time.monotonic()
    done = hpc_ddp("submit", ["cluster=slurm", *SMALL, f"run_dir={run}", "wait=true"],
                   env=env, timeout=240)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "eval accuracy" in done.stdout, said  # the results table: it ended COMPLETED
    assert said.count(NOTE) == 1 and "accounting storage is disabled" in said, said
    waited = time.monotonic() - started

    status = hpc_ddp("status", [str(run), "--json"], env=env, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    (row,) = json.loads(status.stdout)["runs"]
    assert row["state"] == "COMPLETED", row
    for module, args in (("status", [str(run), "--watch", "--interval", "1"]),
                         ("logs", [str(run), "--follow"])):
        ended = hpc_ddp(module, args, env=env, timeout=60)
        assert ended.returncode == 0, (module, ended.stdout, ended.stderr)
    stop = hpc_ddp("status", [str(run), "--stop"], env=env, timeout=60)
    assert "had ended already" in stop.stdout, stop.stdout + stop.stderr
    api = subprocess.run(
        [sys.executable, "-c", "import hpc_ddp, json; r = hpc_ddp.open_run("
         f"{str(run)!r}); print(json.dumps(r.wait(timeout=60, progress=False)['global_step']))"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert api.returncode == 0 and api.stdout.strip().endswith("6"), api.stdout + api.stderr
    resumed = hpc_ddp("submit", ["cluster=slurm", f"run_dir={run}", "resume=true",
                                 "trainer.max_steps=8", "wait=true"], env=env, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    # After the controller forgot the job (MinJobAge): the run's own records say how it
    # ended. A job id the controller does not hold stands for that here.
    job = json.loads((run / "job.json").read_text())
    job["job_id"] = job["history"][-1]["job_id"] = "987654"
    (run / "job.json").write_text(json.dumps(job))
    (run / "summary.json").touch()
    status = hpc_ddp("status", [str(run), "--json"], env=env, timeout=60)
    (row,) = json.loads(status.stdout)["runs"]
    assert row["state"] == "COMPLETED", (row, status.stderr)
    watch = hpc_ddp("status", [str(run), "--watch", "--interval", "1"], env=env, timeout=60)
    assert watch.returncode == 0, watch.stdout + watch.stderr
    print(f"no accounting: a 6-step run submitted and waited for in {waited:.1f} s")


def test_without_accounting_a_failure_ends_failed(
        hpc_ddp: Run, no_accounting: dict[str, str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=2", f"run_dir={run}", "wait=true",
                              "entry=tests.usercode.entries:fails_in_own_code",
                              "cluster.max_restarts=0", "cluster.restarts_in_place=0"],
                   env=no_accounting, timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    status = hpc_ddp("status", [str(run), "--json"], env=no_accounting, timeout=60)
    (row,) = json.loads(status.stdout)["runs"]
    assert row["state"] == "FAILED", row
