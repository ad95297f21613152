"""One job writes a run dir at a time: ``run_dir/owner.json`` names it.

Two jobs on one run dir (two ``sbatch jobs/train.sbatch ... resume=true``, a resume while the
first still runs) would write each other's checkpoints and logs. Rank 0 claims the run dir at
start; a later job finds the claim, asks whether its job still lives (Slurm, one squeue call
by rank 0 alone; a local run's pid on the same host) and refuses while it does. A claim is
only a file naming a job, so it survives the death of every node: a dead job's claim is
simply taken over, and a requeued attempt of the owning job is the owner.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.errors import UserError
from hpc_ddp.procs import pid_alive, start_time
from hpc_ddp.rundir import write_text
from hpc_ddp.slurm.requeue import squeue_job

FILE = "owner.json"


def me(environ: Mapping[str, str], host: str) -> dict[str, Any]:
    """This job as a claim: the Slurm job (whichever step or attempt), else this run's local
    job (submitit's local controller, or this process). A task of a job array is named
    ``<array>_<task>``: the array's first task has the array's own id, and ``squeue -j``
    of that id lists every task of the array, so a dead task would look alive while
    another runs (https://slurm.schedmd.com/job_array.html)."""
    if environ.get("SLURM_JOB_ID") and "SUBMITIT_LOCAL_JOB_ID" not in environ:
        array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
        job = f"{array}_{task}" if array and task else environ["SLURM_JOB_ID"]
        return {"kind": "slurm", "job": job, "host": host}
    pid = int(environ.get("SUBMITIT_LOCAL_JOB_ID") or os.getppid())
    return {"kind": "local", "job": str(pid), "host": host, "started": start_time(pid)}


def slurm_job_alive(job: str, environ: Mapping[str, str]) -> bool | None:
    """Whether Slurm still has the job (pending, running, completing); None: cannot ask."""
    done = squeue_job(job, "%T", environ)
    if done is None:
        return None
    if done.returncode != 0:
        return False if "Invalid job id" in done.stderr else None
    # COMPLETING: its tasks have ended (Slurm runs the epilog); they write nothing any more.
    return done.stdout.strip() not in ("", "COMPLETING")


def alive(claim: Mapping[str, Any], host: str, environ: Mapping[str, str],
          slurm_alive: Callable[[str, Mapping[str, str]], bool | None] = slurm_job_alive
          ) -> bool | None:
    """Whether the claiming job still runs; None when this process cannot tell."""
    if claim.get("kind") == "slurm":
        return slurm_alive(str(claim.get("job")), environ)
    if claim.get("host") != host:
        return None  # a local run's pid means something only on its own machine
    try:
        return pid_alive(int(claim.get("job", 0)), claim.get("started"))
    except (TypeError, ValueError):
        return None


def claim(run_root: Path, mine: dict[str, Any], host: str, environ: Mapping[str, str],
          slurm_alive: Callable[[str, Mapping[str, str]], bool | None] = slurm_job_alive
          ) -> None:
    """Make ``mine`` the run dir's owner, or raise UserError while another live job is."""
    path = run_root / FILE
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError):
        held = None
    if isinstance(held, dict) and (held.get("kind"), held.get("job")) != (mine["kind"],
                                                                          mine["job"]):
        if alive(held, host, environ, slurm_alive):
            shown = f"{held.get('kind')} job {held.get('job')}"
            stop = (f"scancel {held.get('job')}" if held.get("kind") == "slurm" else
                    f"python -m hpc_ddp.status {run_root} --cancel")
            raise UserError("run_dir", str(run_root), f"is being written by {shown}, which "
                            "still runs; a second job would overwrite its checkpoints.",
                            f"wait for it to end or stop it ({stop}; it checkpoints), then "
                            "resume; or choose another run_dir.")
    run_root.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(mine))
