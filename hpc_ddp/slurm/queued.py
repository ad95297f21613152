"""The job behind a run dir that does not exist yet: a run started by
``sbatch jobs/train.sbatch ... run_dir=DIR`` makes DIR (and its job.json, hpc_ddp/train.py)
only once the job starts, so while it is pending only Slurm knows it.

One ``squeue`` call: the user's jobs (or the one job id given), each with its folder (``%Z``,
where sbatch ran) and its command line (``%o``: the batch script and its arguments). A job's
run dir is found as jobs/train.sbatch finds it: the last ``run_dir=`` argument before a
script's ``--``, relative to that folder, else ``outputs/job-<jobid>`` there.
https://slurm.schedmd.com/squeue.html#OPT_format
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# -t all: a job cancelled or failed before it started (no run dir ever made) is still
# listed while the controller keeps it (MinJobAge). %Z: the folder sbatch ran in; %o: the
# command and its arguments, joined by spaces.
SQUEUE_FORMAT = "%i|%T|%Z|%o"
_JOB_ID = re.compile(r"^\d+(_\d+)?$")


@dataclass(frozen=True)
class Queued:
    """A job of the user's as squeue lists it, and the run dir its arguments name."""

    job_id: str
    state: str
    run_dir: Path

    def record(self) -> dict[str, str]:
        """What job.json will hold once the job starts (train.py's record_job)."""
        return {"kind": "slurm", "job_id": self.job_id, "started_by": "sbatch"}


def is_job_id(text: str) -> bool:
    return bool(_JOB_ID.match(text))


def run_dir_of(job_id: str, work_dir: str, command: str) -> Path:
    """The run dir a job of jobs/train.sbatch writes to (its arguments, as the script reads
    them; quotes around the value taken off as it does)."""
    found = f"outputs/job-{job_id}"
    for arg in command.split()[1:]:
        if arg == "--":
            break
        if arg.startswith("run_dir="):
            found = arg.removeprefix("run_dir=").strip("'\"")
    return Path(work_dir, os.path.expanduser(found)).absolute()


def parse(text: str) -> list[Queued]:
    """squeue's lines (SQUEUE_FORMAT) -> the jobs, with their run dirs."""
    found = []
    for line in text.splitlines():
        fields = line.split("|", 3)
        if len(fields) == 4 and is_job_id(fields[0].strip()):
            job_id, state, work_dir, command = (f.strip() for f in fields)
            found.append(Queued(job_id, state, run_dir_of(job_id, work_dir, command)))
    return found


def queued(job_id: str | None = None, environ: Mapping[str, str] | None = None
           ) -> list[Queued]:
    """The user's jobs Slurm holds (only ``job_id`` when given); [] where squeue cannot
    answer."""
    env = dict(os.environ if environ is None else environ)
    which = ["-j", job_id] if job_id else ["-u", str(os.getuid())]
    try:
        done = subprocess.run(["squeue", "-h", "-t", "all", *which, "-o", SQUEUE_FORMAT],
                              env=env, capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse(done.stdout) if done.returncode == 0 else []


def job_for(path: str, environ: Mapping[str, str] | None = None) -> Queued | None:
    """The job of a run dir not made yet (``path``), or of a job id (``path`` given as
    one); None when Slurm holds no such job."""
    if is_job_id(path):
        found = queued(path, environ)
        return next((q for q in found if q.job_id == path), None)
    where = Path(path).absolute()
    return next((q for q in queued(None, environ) if q.run_dir == where), None)


# The jobs of run dirs not made yet that this process was asked about, by run dir: their
# job.json until the job makes its own (a status --watch then reads that).
KNOWN: dict[Path, dict[str, str]] = {}


def run_dir_for(path: Path, typed: str) -> Path:
    """The run dir of a pending sbatch job named by its run dir (``path``, not made yet) or
    its job id (``typed``), remembered in KNOWN; UserError when Slurm holds no such job."""
    from hpc_ddp.errors import UserError  # deferred (start-up): errors

    job = job_for(typed if is_job_id(typed) else str(path))
    if job is None:
        raise UserError("path", typed, "does not exist, and no job of yours that Slurm holds "
                        "writes there.", "pass a run dir (submit prints it), a sweep dir "
                        "(sweep.dir), or the job id sbatch printed: `sbatch jobs/train.sbatch` "
                        "makes its run dir only when the job starts.")
    KNOWN[job.run_dir] = job.record()
    return job.run_dir
