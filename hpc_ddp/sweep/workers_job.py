"""An adaptive sweep's workers on Slurm: one job array, each task a worker's allocation.

Each task asks for what one trial needs (the trial config's nodes, tasks, CPUs, GPUs,
partition, time) and its batch script runs the worker (sweep/worker.py) on the first node;
the worker runs each trial as a step of that allocation (``cluster=step``), so a trial
starts the moment the last one ended, with no queue wait in between. One ``sbatch`` for the
whole sweep. ``--signal`` reaches the trial's step ahead of the limit: its ranks checkpoint,
the worker requeues its own task, and the restarted worker resumes the same trial.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from hpc_ddp.config.schema import Config
from hpc_ddp.config.secrets import shell_lines
from hpc_ddp.config.validate import SLURM_NAMED
from hpc_ddp.errors import UserError
from hpc_ddp.rundir import write_text

SCRIPT = "workers.sbatch"


def script(cfg: Config, folder: Path, n_jobs: int, python: str = sys.executable) -> str:
    """The workers' batch script (pure)."""
    c = cfg.cluster
    tasks = c.tasks_per_node or 1
    flags = [f"--job-name={c.job_name}-study", f"--array=0-{n_jobs - 1}",
             f"--nodes={cfg.nodes}", f"--ntasks-per-node={tasks}",
             f"--cpus-per-task={c.cpus_per_task}", f"--time={c.time_min}",
             # The trial's step gets the signal ahead of the limit
             # (https://slurm.schedmd.com/sbatch.html#OPT_signal); the worker requeues.
             f"--signal={c.signal.removeprefix('SIG')}@{c.signal_delay_s}", "--requeue",
             f"--output={folder}/workers/worker-%a-%A.out"]
    flags += [f"--{name}={getattr(c, name)}" for name in SLURM_NAMED if getattr(c, name)]
    if c.exclusive:
        flags.append("--exclusive")
    if c.mem_gb:
        flags.append(f"--mem={int(c.mem_gb * 1024)}M")
    if c.gpus_per_node:
        flags.append(f"--gpus-per-node={c.gpus_per_node}")
    lines = ["#!/bin/bash", *(f"#SBATCH {flag}" for flag in flags),
             f"umask {c.umask}", *shell_lines(c.setup),
             f"exec {shlex.quote(python)} -m hpc_ddp.sweep.worker {shlex.quote(str(folder))} "
             '"$SLURM_ARRAY_TASK_ID"', ""]
    return "\n".join(lines)


def submit(cfg: Config, folder: Path, n_jobs: int, environ: Mapping[str, str]) -> str:
    """sbatch the workers' array; its job id."""
    path = folder / SCRIPT
    (folder / "workers").mkdir(parents=True, exist_ok=True)
    write_text(path, script(cfg, folder, n_jobs))
    try:
        done = subprocess.run(["sbatch", "--parsable", str(path)], env=dict(environ),
                              capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError("cluster", "slurm", f"sbatch could not run: {exc}",
                        "run the sweep where Slurm's commands work (a login node).") from None
    if done.returncode != 0:
        raise UserError("cluster", "slurm", "sbatch refused the workers' job array: "
                        f"{done.stderr.strip() or done.stdout.strip()}",
                        f"fix what sbatch says (the script: {path}).")
    return done.stdout.strip().split(";")[0]
