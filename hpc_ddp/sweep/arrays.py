"""A Slurm sweep's job arrays: points grouped by identical Slurm parameters, split to fit
MaxArraySize, one sbatch each; every point's job id recorded in the manifest as its array
goes out. A stop signal meanwhile (launch/interrupts.py) waits until the array being
submitted is out and recorded, then no more go out, and the command says what did."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp import api
from hpc_ddp.config import secrets
from hpc_ddp.errors import UserError
from hpc_ddp.launch import interrupts
from hpc_ddp.launch.interrupts import exit_code
from hpc_ddp.rundir import RunDir, write_json
from hpc_ddp.sweep.expand import chunks
from hpc_ddp.sweep.timing import Phases

MANIFEST = "sweep.json"


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def max_array_size(environ: Mapping[str, str]) -> int:
    """MaxArraySize of the cluster (array task ids must stay below it); 1001 if unknown."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], env=dict(environ),
                             capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 1001
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "MaxArraySize" and value.strip().isdigit():
            return int(value.strip())
    return 1001  # Slurm's default


def groups(plans: list[api.Plan]) -> list[list[int]]:
    """Point indices grouped by identical Slurm parameters (one array, or more, each)."""
    # deferred: hostlist
    from hpc_ddp.launch import slurm

    found: dict[str, list[int]] = {}
    for i, plan in enumerate(plans):
        key = json.dumps(slurm.executor_parameters(plan.cfg), sort_keys=True, default=str)
        found.setdefault(key, []).append(i)
    return list(found.values())


def arrays(plans: list[api.Plan], folder: Path,
           environ: Mapping[str, str]) -> Iterator[tuple[list[int], Any]]:
    """Each job array as it would be submitted: its points (grouped by Slurm parameters,
    split to fit MaxArraySize) and submitit's executor for it, after the shell-safety checks.
    submitit keeps the array's files in <sweep dir>/submitit/<array>_<task>/."""
    # deferred: hostlist
    from hpc_ddp.launch import slurm

    size = plans[0].cfg.sweep.max_array_size or max_array_size(environ)
    parallel = plans[0].cfg.sweep.parallel
    for members in groups(plans):
        for part in chunks(len(members), size):
            indices = [members[k] for k in part]
            for i in indices:
                slurm.check_shell_safety(plans[i].cfg)
            # Each task's node-loss driver acts on its own point's events (slurm/driver.py).
            points = [str(plans[i].run_dir.root.relative_to(folder)) for i in indices]
            executor = slurm.make_executor(plans[members[0]].cfg, RunDir(folder), points)
            executor.update_parameters(array_parallelism=parallel or len(indices))
            yield indices, executor


def submit_arrays(manifest: dict[str, Any], plans: list[api.Plan], folder: Path,
                  environ: Mapping[str, str], phases: Phases) -> None:
    """One sbatch per array: points grouped by identical Slurm parameters, then chunked."""
    # deferred (start-up): inputs.run_dir
    from hpc_ddp.inputs.run_dir import write_run_config

    for indices, executor in arrays(plans, folder, environ):
        with phases.timed("folders"):
            texts = {i: write_run_config(plans[i].run_dir, plans[i].cfg, plans[i].overrides)
                     for i in indices}
        hidden = {k: v for i in indices for k, v in plans[i].secrets.items()}
        with interrupts.held():  # a stop signal waits until this array is out and recorded
            _submit_array(manifest, plans, indices, executor, texts, hidden, folder, environ,
                          phases)


def _submit_array(manifest: dict[str, Any], plans: list[api.Plan], indices: list[int],
                  executor: Any, texts: dict[int, str], hidden: dict[str, str], folder: Path,
                  environ: Mapping[str, str], phases: Phases) -> None:
    # deferred: hostlist
    from hpc_ddp.launch import slurm
    from hpc_ddp.rank.main.task import training_task

    try:
        with phases.timed("submission (pickles, sbatch)"), secrets.exported(hidden), \
                slurm.sbatch_errors(plans[indices[0]].cfg, environ), executor.batch():
            jobs = [executor.submit(training_task(texts[i], str(plans[i].run_dir.root)))
                    for i in indices]
        phases.count("sbatch calls")
    except UserError as refused:
        sent = sum(p["job_id"] is not None for p in manifest["points"])
        done = (f"{sent} of {len(plans)} points were submitted before; "
                f"{folder / MANIFEST} lists them" if sent else "nothing was submitted")
        raise UserError(refused.key, refused.value, f"{refused.problem} ({done})",
                        refused.fix) from None
    manifest["arrays"].append(str(jobs[0].job_id).split("_")[0])
    with phases.timed("folders"):
        for i, job in zip(indices, jobs, strict=True):
            manifest["points"][i]["job_id"] = str(job.job_id)
            _write_job(plans[i], "slurm", str(job.job_id))


def _write_job(plan: api.Plan, kind: str, job_id: str) -> None:
    record: dict[str, Any] = {"kind": kind, "job_id": job_id, "submitted": time.time()}
    write_json(plan.run_dir.root / api.JOB_FILE, {**record, "history": [record]})


def stopped_submitting(manifest: dict[str, Any], folder: Path, created: bool,
                       exc: BaseException, out: TextIO) -> int:
    """A stop signal while the arrays went out (launch/interrupts.py holds it until the
    array being submitted is out): say what was submitted, submit no more."""
    sent = sum(p["job_id"] is not None for p in manifest["points"])
    name = interrupts.name(exc)
    if not sent:
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        print(f"stopped ({name}) before any point was submitted: nothing of the sweep runs.",
              file=out, flush=True)
        return exit_code(exc)
    write_json(folder / MANIFEST, manifest)
    print(f"stopped ({name}): {sent} of {count(len(manifest['points']), 'point')} went out "
          f"(job array(s) {', '.join(manifest['arrays'])}) and run; the others were not "
          f"submitted. python -m hpc_ddp.status {shlex.quote(str(folder))} shows them "
          "(--cancel cancels them).", file=out, flush=True)
    return exit_code(exc)
