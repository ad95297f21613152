"""A Slurm job's state from accounting (sacct), with squeue as the fallback.

submitit's own ``done()`` trusts its result files, which an earlier attempt of a requeued
job leaves behind; following a job that requeues itself needs Slurm's word.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

# States after which the job will not run again (REQUEUED, PENDING, RUNNING, PREEMPTED and
# SUSPENDED are not: a requeued or preempted job comes back). https://slurm.schedmd.com/sacct.html#SECTION_JOB-STATE-CODES
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE")


@dataclass(frozen=True)
class JobState:
    state: str
    exit_code: str = ""

    @property
    def finished(self) -> bool:
        # "CANCELLED by 1000" -> CANCELLED; an empty state (a record sacct has not filled
        # yet) is not an end.
        return next(iter(self.state.split()), "") in TERMINAL


def query(job_id: str, environ: Mapping[str, str] | None = None) -> JobState | None:
    """The job's state now (None while neither sacct nor squeue knows it yet)."""
    env = dict(os.environ if environ is None else environ)
    out = _run(["sacct", "-X", "-n", "-P", "-o", "State,ExitCode", "-j", job_id], env)
    if out:
        state, _, code = out.splitlines()[0].partition("|")
        return JobState(state.strip(), code.strip())
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"], env)
    if out:
        return JobState(out.splitlines()[0].strip())
    return _array_element(job_id, env) if "_" in job_id else None


def _array_element(job_id: str, env: dict[str, str]) -> JobState | None:
    """An array task that never started (still pending, or cancelled while pending) has no
    record of its own: accounting lists it in a range such as 123_[4-9]."""
    from hpc_ddp import hostlist

    array = job_id.split("_")[0]
    out = _run(["sacct", "-X", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", array], env)
    for line in out.splitlines():
        ids, state, code = (line.split("|") + ["", ""])[:3]
        try:
            # "123_[4-9%2]": the range, without the array's %N throttle.
            bare = ids.split("%")[0] + ("]" if "%" in ids else "")
            members = hostlist.expand(bare) if "[" in bare else [bare]
        except ValueError:
            continue
        if job_id in members:
            return JobState(state.strip(), code.strip())
    return None


def _run(cmd: list[str], env: dict[str, str]) -> str:
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


class SlurmJobView:
    """What ``follow`` needs of a Slurm job: id, state, done(), cancel()."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self._last: JobState | None = None

    @property
    def state(self) -> str:
        return self._last.state if self._last else "UNKNOWN"

    @property
    def exit_code(self) -> str:
        return self._last.exit_code if self._last else ""

    def done(self) -> bool:
        self._last = query(self.job_id) or self._last
        return bool(self._last and self._last.finished)

    def cancel(self, check: bool = False) -> None:
        """scancel the job; with ``check``, a refusal is a UserError carrying scancel's reason.
        Without scancel on PATH the job cannot be cancelled from here, which is always said."""
        from hpc_ddp.errors import UserError

        try:
            done = subprocess.run(["scancel", self.job_id], capture_output=True, text=True,
                                  check=False)
        except FileNotFoundError:
            raise UserError("job", self.job_id, "cannot be cancelled here: scancel is not on "
                            "PATH.", f"run `scancel {self.job_id}` on a login node of the "
                            "cluster.") from None
        if check and done.returncode != 0:
            said = next((ln.strip() for ln in done.stderr.splitlines() if ln.strip()), "")
            raise UserError("job", self.job_id, f"scancel refused: {said or done.returncode}",
                            "check the id with `squeue -j` / `sacct -j`, and that a Slurm "
                            "controller answers (`scontrol ping`).")
