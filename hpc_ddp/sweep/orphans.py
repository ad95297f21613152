"""A trial whose worker is gone for good: found and resumed by a worker that is free.

A worker keeps its trial RUNNING while it is away on purpose: requeued at the time limit,
preempted, or put back in the queue by Slurm after its node went down; it resumes the trial
when it starts again (sweep/worker.py). A worker that will never start again (cancelled,
its requeues spent, a local process killed) would leave its trial RUNNING forever, and the
study short of ``n_trials``. So a worker about to draw a trial first looks at the other
workers' files (``workers/<index>.json``: the trial each holds and who holds it) and takes
over a RUNNING trial whose worker is gone, from that trial's checkpoint: the trial is
resumed, not run again, as Optuna's heartbeat retries a stale trial
(https://optuna.readthedocs.io/en/stable/reference/generated/optuna.storages.RetryFailedTrialCallback.html).

Gone means, for a worker of a Slurm job array, that its array task (``<array>_<task>``) is
no longer in the queue, running or pending (one ``squeue`` for the array, and only when
some other worker holds a RUNNING trial); for a local worker, that its process is no longer
alive on this host and its trial's run has ended too (a local run outlives a worker killed
with SIGKILL: its ranks train on to the end, and the trial is then taken over as finished).
A worker whose files say nothing of who holds them (an older sweep) is never taken over.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.procs import pid_alive
from hpc_ddp.rundir import read_json
from hpc_ddp.sweep.study import trial_dir


def identity(environ: Mapping[str, str]) -> dict[str, Any]:
    """Who this worker is, as its file records it."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return {"job": f"{array}_{task}" if array and task else None,
            "host": socket.gethostname(), "pid": os.getpid()}


def queued(arrays: Iterable[str], environ: Mapping[str, str]) -> set[str] | None:
    """The array tasks of ``arrays`` still in Slurm's queue (``<array>_<task>``), or None
    when squeue could not say (then nobody is taken for gone)."""
    wanted = sorted(set(arrays))
    if not wanted:
        return set()
    try:
        done = subprocess.run(["squeue", "-h", "-r", "-j", ",".join(wanted), "-o", "%i"],
                              env=dict(environ), capture_output=True, text=True, timeout=60,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return {line.strip() for line in done.stdout.splitlines() if line.strip()}


def gone(record: Mapping[str, Any], in_queue: set[str] | None, host: str,
         trial_run: Path | None = None) -> bool:
    """Whether the worker that wrote ``record`` will never come back, and nothing of its
    trial runs (pure but for local processes' liveness, read from /proc)."""
    job = record.get("job")
    if isinstance(job, str) and job:
        return in_queue is not None and job not in in_queue
    pid = record.get("pid")
    if record.get("host") != host or not isinstance(pid, int):
        return False  # another host's process, or nothing recorded: not ours to judge
    return not _worker_alive(pid) and not (trial_run is not None and _run_alive(trial_run))


def _run_alive(run_dir: Path) -> bool:
    """A local trial's run still has its controller (launch/control.py's job.json)."""
    from hpc_ddp.launch.control import JOB_FILE  # deferred (start-up): launch.control

    job = read_json(run_dir / JOB_FILE) or {}
    pid = job.get("controller_pid")
    return isinstance(pid, int) and pid_alive(pid, job.get("controller_start"))


def read_worker_file(path: Path, folder: Path) -> dict[str, Any] | None:
    """A worker's file, read only as this user's file in a sweep folder no one else can
    write (owned.py): the trial it names is the one a worker resumes or takes over. None
    when missing, unreadable, or someone else's (said once, on the worker's output)."""
    from hpc_ddp.owned import Untrusted, read_owned  # deferred (start-up): owned

    try:
        data = json.loads(read_owned(path, folder))
    except FileNotFoundError:
        return None
    except Untrusted as exc:
        print(f"{path} is not read: {exc}", flush=True)
        return None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _worker_alive(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"hpc_ddp.sweep.worker" in cmdline


def orphan(folder: Path, mine: Path, running: set[int],
           environ: Mapping[str, str]) -> tuple[int, Path, dict[str, Any]] | None:
    """A RUNNING trial (its number in ``running``) held by another worker that is gone: the
    trial, that worker's file and what it says; None when there is none."""
    held = []
    for path in sorted((folder / "workers").glob("*.json")):
        record = None if path == mine else read_worker_file(path, folder)
        if record is None:
            continue
        number = record.get("trial")
        if isinstance(number, int) and number in running:
            held.append((number, path, record))
    if not held:
        return None
    arrays = [str(r["job"]).split("_")[0] for _, _, r in held if isinstance(r.get("job"), str)]
    in_queue = queued(arrays, environ) if arrays else set()
    host = socket.gethostname()
    for number, path, record in held:
        if gone(record, in_queue, host, trial_dir(folder, number)):
            return number, path, record
    return None
