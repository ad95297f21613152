"""``python -m hpc_ddp.status RUN --stop``: stop a run at a step its ranks agree on, with a
checkpoint, as Ctrl-C does for a followed local run (docs/observability.md#runs-that-outlive-
the-terminal): the ranks get SIGTERM (a local run's and a step's through their controller, a
Slurm job's through scancel), agree on a step, save it and exit; then where it stopped, and
the line that continues it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TextIO

from hpc_ddp.api import JOB_FILE, Run
from hpc_ddp.errors import UserError
from hpc_ddp.owned import Untrusted, read_owned
from hpc_ddp.rundir import read_json, resume_command

# Seconds the ranks get to checkpoint before what is left is killed (as Ctrl-C's).
GRACE_S = 120.0


def stop(runs: list[tuple[str, Path]], out: TextIO) -> int:
    """Stop every run of ``runs`` that has not ended; 0 when each one stopped or had ended."""
    # deferred (start-up): follow
    from hpc_ddp.watch.follow import stopped_how

    for label, run_dir in runs:
        job = read_json(run_dir / JOB_FILE)
        if not job:
            continue
        run = Run(run_dir, job)
        if run.done():
            print(f"{label} (job {run.job_id}) had ended already; nothing to stop", file=out)
            continue
        print(f"{label} (job {run.job_id}): the ranks checkpoint at a step they agree on and "
              "stop...", file=out, flush=True)
        run.cancel(grace_s=GRACE_S)
        deadline = time.monotonic() + GRACE_S
        # A cancel that returned at once (scancel): the job ends once its ranks checkpointed.
        while not run.job.cancel_waits and not run.done() and time.monotonic() < deadline:
            time.sleep(run.job.poll_s)
        print(f"{label}: {stopped_how(run.files, killed=False)} Continue with: "
              f"{resume_command(run_dir)}", file=out, flush=True)
    return 0


def acted_on(path: Path, runs: list[tuple[str, Path]]) -> None:
    """UserError unless every file --stop and --cancel act on (each run's job.json, a sweep's
    sweep.json: the processes and job ids they end) passed the ownership checks a resume
    makes (hpc_ddp/owned.py): a job.json another user planted would have this command kill
    their choice of process, or scancel their choice of jobs (docs/security.md)."""
    files = [(run_dir, run_dir / JOB_FILE) for _, run_dir in runs]
    files.append((path, path / "sweep.json"))
    for root, file in files:
        if not file.exists():
            continue
        try:
            read_owned(file, root)
        except Untrusted as exc:
            raise UserError("path", str(path), f"{exc} --stop and --cancel act only on runs "
                            "you made.", "stop or cancel it as the user who made it "
                            "(or ask them to).") from None
