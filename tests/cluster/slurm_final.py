"""What Slurm itself says of a job's end: every cluster test that expects success checks it.

A run can write its summary and still end FAILED in Slurm (a task that aborted at exit did
exactly that); ``afterok`` dependencies, dashboards built on sacct and the user read Slurm's
state, so the tests do too. Plain sacct, parsed here: the check does not go through
hpc_ddp's own reading of Slurm (slurm/state.py), which it would then trust.
"""

from __future__ import annotations

import subprocess
import time

# States in which a job or step may still change (https://slurm.schedmd.com/sacct.html#SECTION_JOB-STATE-CODES).
ACTIVE = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED",
          "COMPLETING", "CONFIGURING", "RESIZING", "STAGE_OUT", "SIGNALING", "PREEMPTED"}


def final_rows(job: str, env: dict[str, str], timeout_s: float = 60) -> list[tuple[str, ...]]:
    """(JobID, State, ExitCode) of ``job`` once it has ended: its allocation (every task of
    an array job), or the step itself for ``JOB.STEP``. Accounting may lag the end by a
    moment, so it is read until no row is active."""
    step = "." in job
    command = ["sacct", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", job,
               *([] if step else ["-X"])]
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30,
                             check=False).stdout
        rows = [tuple(line.split("|")) for line in out.splitlines() if line.strip()]
        if step:
            rows = [r for r in rows if r[0] == job]
        # A job that lost a node and lived on (--no-kill) keeps a RESIZING record of the
        # job before it shrank, beside the one that ends: only the last counts.
        rows = [r for r in rows if not ((r[1].split() or [""])[0] == "RESIZING"
                                         and sum(x[0] == r[0] for x in rows) > 1)]
        if rows and not any((r[1].split() or [""])[0] in ACTIVE for r in rows):
            return rows
        if time.monotonic() > deadline:
            raise AssertionError(f"sacct never showed job {job} ended: {rows}")
        time.sleep(0.5)


def assert_completed(job: str, env: dict[str, str], note: str = "",
                     timeout_s: float = 60) -> None:
    """Slurm says ``job`` (each array task, or the step) ended COMPLETED with exit code 0:0,
    waiting up to ``timeout_s`` for it to end. ``note`` (e.g. the job's output) is shown with
    a failure, to tell why."""
    rows = final_rows(job, env, timeout_s)
    bad = [r for r in rows if r[1:] != ("COMPLETED", "0:0")]
    assert not bad, f"job {job} did not end COMPLETED 0:0 in Slurm (sacct: {rows})\n{note}"


def assert_ended(job: str, env: dict[str, str], state: str, note: str = "") -> None:
    """Slurm says ``job`` ended in ``state`` (e.g. FAILED) with a non-zero exit code."""
    rows = final_rows(job, env)
    assert all((r[1].split() or [""])[0] == state and r[2] != "0:0" for r in rows), (
        f"job {job} did not end {state} in Slurm (sacct: {rows})\n{note}")
