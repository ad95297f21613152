"""Sweeps on the real cluster: job arrays split to fit MaxArraySize, returning at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster.slurm_final import final_rows
from tests.cluster.test_slurm_submit import SMALL, assert_sweep_completed

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]


def status_rows(hpc_ddp: Run, sweep: Path, env: dict[str, str]) -> dict:  # type: ignore[type-arg]
    done = hpc_ddp("status", [str(sweep), "--json"], env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_four_point_sweep_of_two_node_jobs_in_two_arrays(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    """A sweep of 2-node jobs split into two arrays of two (sweep.max_array_size=2; the
    cluster's own MaxArraySize is read in test_sweep_scale.py), returning at once, every point
    COMPLETED. Four points: the four jobs fit the cluster at once."""
    sweep = tmp_path / "sweep"
    # cluster.python is the interpreter of every array task, too: a wrapper that leaves a mark.
    marks = tmp_path / "marks"
    marks.mkdir()
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text("#!/bin/sh\n"
                       f'touch "{marks}/$SLURM_ARRAY_JOB_ID-$SLURM_ARRAY_TASK_ID-$SLURM_PROCID"\n'
                       f'exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    started = time.monotonic()
    # Each rank trains in its own process, without a supervisor (the sweep is what is tested
    # here; supervision in test_fault_tolerance.py): 12 jobs start half the processes.
    done = hpc_ddp("submit", ["-m", "cluster=slurm", "nodes=2", "optim.lr=0.2,0.1,0.05,0.02",
                              "trainer.max_steps=10", *SMALL, "cluster.supervise=false",
                              "sweep.max_array_size=2",
                              f"cluster.python={wrapper}", f"sweep.dir={sweep}"], env=slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr
    returned_after = time.monotonic() - started
    manifest = json.loads((sweep / "sweep.json").read_text())
    points = manifest["points"]
    assert len(points) == 4
    # At most 2 points an array: 4 points need two arrays, one sbatch each.
    assert len(manifest["arrays"]) == 2
    assert {p["job_id"].split("_")[0] for p in points} == set(manifest["arrays"])
    assert not all((Path(p["run_dir"]) / "summary.json").exists() for p in points)
    assert returned_after < 60
    queued = subprocess.run(["squeue", "-h", "-r", "-o", "%A %F"], env=slurm_env,
                            capture_output=True, text=True, check=True).stdout
    assert {line.split()[1] for line in queued.splitlines()} & set(manifest["arrays"])
    during = status_rows(hpc_ddp, sweep, slurm_env)
    assert {r["state"] for r in during["runs"]} <= {"PENDING", "RUNNING", "COMPLETED",
                                                    "COMPLETING"}
    deadline = time.monotonic() + 600
    while not all((Path(p["run_dir"]) / "summary.json").exists() for p in points):
        assert time.monotonic() < deadline, "the sweep did not finish"
        time.sleep(2)
    for p in points:
        summary = json.loads((Path(p["run_dir"]) / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["global_step"] == 10
        assert len(set(summary["hosts"])) == 2
    job_ids = {p["job_id"].replace("_", "-") for p in points}
    assert {m.name for m in marks.iterdir()} == {f"{j}-{r}" for j in job_ids for r in (0, 1)}
    assert_sweep_completed(sweep, slurm_env)  # both arrays, all 4 tasks
    deadline = time.monotonic() + 60
    while True:
        after = status_rows(hpc_ddp, sweep, slurm_env)
        if {r["state"] for r in after["runs"]} == {"COMPLETED"} or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {r["state"] for r in after["runs"]} == {"COMPLETED"}
    best = max(after["runs"], key=lambda r: r["eval_accuracy"])
    assert after["best"]["label"] == best["label"]
    text = hpc_ddp("status", [str(sweep), "--plot", str(tmp_path / "c.png")], env=slurm_env)
    assert f"best point: {best['label']}" in text.stdout and (tmp_path / "c.png").exists()


def test_cancel_a_whole_sweep(hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = hpc_ddp("submit", ["-m", "cluster=slurm", "optim.lr=0.1,0.01,0.001",
                              "trainer.max_steps=100000", f"sweep.dir={sweep}",
                              "sweep.max_array_size=2"], env=slurm_env)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((sweep / "sweep.json").read_text())
    assert len(manifest["arrays"]) == 2  # split by the configured maximum
    cancel = hpc_ddp("status", [str(sweep), "--cancel"], env=slurm_env)
    assert cancel.returncode == 0
    deadline = time.monotonic() + 60
    while True:
        states = {r["state"].split()[0] for r in status_rows(hpc_ddp, sweep, slurm_env)["runs"]}
        if states == {"CANCELLED"} or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert states == {"CANCELLED"}
    # Slurm's own account, too: every task of both arrays ended CANCELLED.
    for array in manifest["arrays"]:
        rows = final_rows(array, slurm_env)
        assert rows and all(r[1].split()[0] == "CANCELLED" for r in rows), rows


def test_requeueing_one_point_leaves_the_others_alone(hpc_ddp: Run, slurm_env: dict[str, str],
                                                      tmp_path: Path) -> None:
    from tests.cluster.test_fault_tolerance import (
        ARGS,
        STEPS,
        finish_releasing_requeues,
        wait_for_step,
    )

    sweep = tmp_path / "sweep"
    args = [a for a in ARGS if not a.startswith(("cluster=", "trainer.seed"))]
    done = hpc_ddp("submit", ["-m", "cluster=slurm", "trainer.seed=0,1", *args,
                              f"sweep.dir={sweep}"], env=slurm_env)
    assert done.returncode == 0, done.stderr
    first, second = json.loads((sweep / "sweep.json").read_text())["points"]
    wait_for_step(Path(first["run_dir"]), 30)
    subprocess.run(["scancel", "--signal=USR2", "--full", first["job_id"]], env=slurm_env,
                   check=True)
    finish_releasing_requeues(first["job_id"], Path(first["run_dir"]), slurm_env)
    finish_releasing_requeues(second["job_id"], Path(second["run_dir"]), slurm_env)
    summaries = [json.loads((Path(p["run_dir"]) / "summary.json").read_text())
                 for p in (first, second)]
    assert [s["restarts"] for s in summaries] == [1, 0]
    assert [s["global_step"] for s in summaries] == [STEPS, STEPS]
    assert_sweep_completed(sweep, slurm_env)  # the requeued task's last start, too


def test_sweep_dry_run_prints_the_array_scripts_and_submits_nothing(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    before = subprocess.run(["squeue", "-h", "-o", "%A"], env=slurm_env, capture_output=True,
                            text=True, check=True).stdout
    done = hpc_ddp("submit", ["-m", "cluster=slurm", "optim.lr=0.1,0.2,0.3", "dry_run=true",
                              "sweep.max_array_size=2", "sweep.parallel=1",
                              f"sweep.dir={sweep}"], env=slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr
    scripts = done.stdout.split("# array of points ")[1:]
    assert len(scripts) == 2  # 3 points, at most 2 per array
    assert "#SBATCH --array=0-1%1" in scripts[0] and "#SBATCH --array=0-0%1" in scripts[1]
    assert "nothing was submitted" in done.stdout and not sweep.exists()
    after = subprocess.run(["squeue", "-h", "-o", "%A"], env=slurm_env, capture_output=True,
                           text=True, check=True).stdout
    assert after == before
    # The scripts are what sbatch would take: it accepts each one without queueing it.
    script = tmp_path / "array.sh"
    script.write_text("#!/bin/bash\n" + scripts[0].split("#!/bin/bash\n", 1)[1])
    test_only = subprocess.run(["sbatch", "--test-only", str(script)], env=slurm_env,
                               capture_output=True, text=True, check=False)
    assert test_only.returncode == 0, test_only.stderr
