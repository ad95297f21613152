"""What a user reads about a Slurm run, checked against Slurm itself (issue 46, "Smaller"): a
resumed run's wall time as sacct spans its jobs, a preempted script told it was preempted,
and the status of an sbatch run whose run dir does not exist yet."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_ddp import events
from tests.cluster.slurm_final import final_rows
from tests.cluster.test_slurm_submit import job_id_of
from tests.conftest import REPO

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]
SMALL = ["cluster=slurm", "nodes=1", "data.train_size=512", "data.eval_size=128",
         "trainer.log_interval=5"]


def _sacct_span(jobs: list[str], env: dict[str, str]) -> float:
    """sacct's first Submit to last End over every start of these jobs."""
    out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-o", "Submit,End", "-j",
                          ",".join(jobs)], env=env, capture_output=True, text=True,
                         check=True).stdout
    rows = [line.split("|") for line in out.splitlines() if line]
    at = [(dt.datetime.fromisoformat(s).timestamp(), dt.datetime.fromisoformat(e).timestamp())
          for s, e in rows]
    return max(e for _, e in at) - min(s for s, _ in at)


def test_a_resumed_runs_wall_time_spans_its_jobs_as_sacct_does(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = hpc_ddp("submit", [*SMALL, "trainer.max_steps=5", f"run_dir={run_dir}",
                               "wait=true"], env=slurm_env, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    time.sleep(5)  # the time between the run and its resume is part of its wall time
    again = hpc_ddp("submit", [f"run_dir={run_dir}", "resume=true", "trainer.max_steps=10",
                               "wait=true"], env=slurm_env, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    jobs = [job_id_of(first.stdout), job_id_of(again.stdout)]
    span = _sacct_span(jobs, slurm_env)
    status = hpc_ddp("status", [str(run_dir), "--json"], env=slurm_env)
    cost = json.loads(status.stdout)["runs"][0]["cost"]
    assert cost["wall_s"] == pytest.approx(span, abs=1e-3) and cost["starts"] == 2, cost
    # The followed resume's line said so too (its sacct may have come before the End).
    printed = re.search(r"cost +wall (?:(\d+)m)?(\d+)s", again.stdout)
    assert printed, again.stdout
    assert int(printed[1] or 0) * 60 + int(printed[2]) == pytest.approx(span, abs=2)


UNHANDLED = '''\
import time
import torch.distributed as dist
dist.init_process_group("gloo")
for step in range(2000):
    print(f"step {step} on rank {dist.get_rank()}", flush=True)
    time.sleep(0.2)
'''


def test_a_preempted_script_is_told_it_was_preempted(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    """A script that does not handle the requeue signal, preempted by the urgent partition
    with 59 of its 60 minutes left: not "sent 120s before the time limit"."""
    script = tmp_path / "plain.py"
    script.write_text(UNHANDLED)
    run_dir = tmp_path / "run"
    # --exclusive: the urgent job must take the node (docs/testcluster.md).
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=1", "cluster.exclusive=true",
                              "trainer.device=cpu", "cluster.time_min=60", f"script={script}",
                              f"run_dir={run_dir}"], env=slurm_env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    job = job_id_of(done.stdout)
    rank0, deadline = run_dir / "logs" / "rank0.log", time.monotonic() + 240
    while "step 5 on rank 0" not in (rank0.read_text() if rank0.exists() else ""):
        assert time.monotonic() < deadline, "the script never reached step 5"
        time.sleep(0.3)
    node = json.loads((run_dir / "ranks" / "rank0.json").read_text())["host"]
    subprocess.run(["sbatch", "-p", "urgent", "--exclusive", f"--nodelist={node}", "-N1",
                    "--time=2", f"--output={tmp_path}/urgent-%j.out", "--wrap=sleep 5"],
                   env=slurm_env, check=True, capture_output=True)
    deadline = time.monotonic() + 240
    while not (failures := [e for e in events.read(run_dir) if e["kind"] == "failure"]):
        assert time.monotonic() < deadline, events.read(run_dir)
        time.sleep(0.5)
    cause = failures[0]["cause"]
    said = re.search(r"the requeue signal \(sent at a preemption or by hand, (\d+)m\d+s before",
                     cause)
    assert said and int(said[1]) >= 55, cause  # of its 60 minutes, not "120s before"
    subprocess.run(["scancel", job], env=slurm_env, check=False)


def test_status_of_an_sbatch_run_still_pending(hpc_ddp: Run, slurm_env: dict[str, str],
                                               tmp_path: Path) -> None:
    """`sbatch jobs/train.sbatch run_dir=...` held in the queue: its run dir does not exist,
    and status (by the run dir, or by the job id sbatch printed) says the job is pending and
    why; --cancel cancels it."""
    sbatch = subprocess.run(
        ["sbatch", "--parsable", "--hold", "-N1", "--ntasks-per-node=1", "--gpus-per-node=0",
         "--cpus-per-task=1", str(REPO / "jobs" / "train.sbatch"), "trainer.device=cpu",
         "trainer.max_steps=5", "run_dir=runs/pending"], env=slurm_env, cwd=tmp_path,
        capture_output=True, text=True, check=True)
    job = sbatch.stdout.strip().split(";")[0]
    run_dir = tmp_path / "runs" / "pending"
    try:
        for given in (str(run_dir), job):
            shown = hpc_ddp("status", [given], env=slurm_env)
            assert shown.returncode == 0, shown.stdout + shown.stderr
            assert f"job {job} waits (JobHeldUser): held" in shown.stdout, shown.stdout
            assert "PENDING" in shown.stdout and "does not exist" not in shown.stderr
        row = json.loads(hpc_ddp("status", [job, "--json"], env=slurm_env).stdout)["runs"][0]
        assert (row["job_id"], row["state"], row["run_dir"]) == (job, "PENDING", str(run_dir))
        assert not run_dir.exists()
        cancelled = hpc_ddp("status", [str(run_dir), "--cancel"], env=slurm_env)
        assert f"cancelled pending (job {job}) before it ever started" in cancelled.stdout
    finally:
        subprocess.run(["scancel", job], env=slurm_env, check=False)
    assert [r[1].split()[0] for r in final_rows(job, slurm_env)] == ["CANCELLED"]
    unknown = hpc_ddp("status", [str(tmp_path / "never")], env=slurm_env)
    assert unknown.returncode == 2 and "the job id sbatch printed" in unknown.stderr
