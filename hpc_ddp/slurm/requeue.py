"""Putting the job back in the queue, within cluster.max_restarts.

The same call submitit makes (``scontrol requeue <job>``); it needs the job to be requeueable
(``--requeue``, which hpc_ddp's sbatch scripts carry, or the cluster's JobRequeue=1).
https://slurm.schedmd.com/scontrol.html#OPT_requeue

Inside a container both commands go through the relay outside it (slurm/relay.py).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping

from hpc_ddp.rank.contract import STEP_OF_ENV
from hpc_ddp.slurm import relay as slurm_relay

log = logging.getLogger(__name__)


def slurm_job(environ: Mapping[str, str]) -> str | None:
    """The id to requeue: this job (an array task has its own SLURM_JOB_ID); None where
    there is nothing to requeue (not on Slurm, or a step of someone's allocation)."""
    if environ.get(STEP_OF_ENV):
        return None
    return environ.get("SLURM_JOB_ID") or None


def squeue_job(job_id: str, field: str, environ: Mapping[str, str]
               ) -> subprocess.CompletedProcess[str] | None:
    """``squeue -h -j <job> -o <field>`` (one call to slurmctld); None when it cannot run."""
    try:
        return slurm_relay.run(["squeue", "-h", "-j", job_id, "-o", field], environ, 30)
    except (OSError, subprocess.TimeoutExpired):
        return None


def job_nodes(job_id: str, environ: Mapping[str, str]) -> list[str] | None:
    """The nodes the job has now (one squeue: a node lost under --no-kill is no longer
    among them); None when Slurm cannot say, or the job is not running."""
    done = squeue_job(job_id, "%T %N", environ)
    if done is None or done.returncode != 0:
        return None
    state, _, listed = done.stdout.strip().partition(" ")
    if state != "RUNNING" or not listed.strip():
        return None
    from hpc_ddp import hostlist  # deferred (start-up): hostlist

    try:
        return hostlist.expand(listed.strip())
    except ValueError:
        return None


def requeue(job_id: str, environ: Mapping[str, str]) -> str | None:
    """Requeue; returns None on success, else Slurm's answer."""
    try:
        done = slurm_relay.run(["scontrol", "requeue", job_id], environ, 60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        said = exc.output if isinstance(exc, subprocess.TimeoutExpired) else None
        return str(said or exc)
    if done.returncode != 0:
        return (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
    log.info("requeued Slurm job %s", job_id)
    return None
