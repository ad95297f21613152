"""Submit an adaptive sweep (``-m hydra/sweeper=optuna``): the study, then its workers.

Everything is checked before anything starts: the study's settings and space (one line and
exit 2 for a bad value), and a first trial's whole config, as a single submit checks it.
Then the study is made in its storage and ``n_jobs`` workers start (sweep/worker.py): on
Slurm as one job array of workers that the command leaves running (it returns at once, as
a grid sweep does); locally as processes it follows until the study is done.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.errors import UserError
from hpc_ddp.rundir import created_with, write_json
from hpc_ddp.sweep import study as studies
from hpc_ddp.sweep import worker
from hpc_ddp.sweep.folder import sweep_dir_for
from hpc_ddp.sweep.study_status import best_lines, best_of


def first_values(space: studies.Space) -> dict[str, Any]:
    """A point of the space (each parameter's first choice or its low end): what is checked
    before the study starts."""
    found: dict[str, Any] = {}
    for key, dist in space.params.items():
        choices = getattr(dist, "choices", None)
        found[key] = choices[0] if choices else dist.low
    return found


def launch(overrides: Sequence[str], out: TextIO, cwd: Path,
           environ: Mapping[str, str]) -> int:
    from hpc_ddp import api  # deferred: the typed schemas

    spec, rest = studies.split(overrides, environ)
    space = studies.space_of(spec, rest)
    if not space.params:
        raise UserError("hydra/sweeper", "optuna", "has no parameter to search.",
                        "sweep at least one key, e.g. 'optim.lr=tag(log, interval(1e-4, 1e-1))'.")
    folder = sweep_dir_for(rest, cwd)
    rest = [o for o in rest if not o.startswith("sweep.dir=")]  # the trials' own overrides
    space = studies.space_of(spec, rest)
    # A first trial's config, checked as a single submit checks it (nothing is made).
    probe = worker.trial_overrides(space, first_values(space), folder / "trial-check", {},
                                   resume=False)
    plan = api.plan(probe, cwd, environ)
    if plan.cfg.dry_run:  # what would run, and on Slurm the workers' script; nothing made
        print(f"adaptive sweep: {spec.n_trials} trials, {spec.n_jobs} at once, into "
              f"{folder}; " + ", ".join(f"{k}: {d}" for k, d in space.params.items()), file=out)
        if plan.cfg.cluster.kind == "slurm":
            from hpc_ddp.sweep.workers_job import script  # deferred: the typed schemas

            print(f"the workers' job array ({folder}/workers.sbatch):\n"
                  f"{script(plan.cfg, folder, spec.n_jobs)}", file=out)
        print("nothing was started.", file=out)
        return 0
    kind = plan.cfg.cluster.kind
    with created_with(plan.cfg.cluster.umask):
        created = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        url = studies.storage_url(spec, folder)
        name = spec.study_name or folder.name
        try:
            studies.open_study(spec, url, name, space, create=True)
        except UserError:
            if created:  # nothing was made: leave nothing
                shutil.rmtree(folder, ignore_errors=True)
            raise
        manifest = {"kind": "adaptive", "cluster": kind, "created": time.time(),
                    "spec": spec.to_json(), "overrides": rest, "storage": url,
                    "study_name": name, "cwd": str(cwd), "folder": str(folder), "workers": []}
        write_json(folder / studies.STUDY, manifest)
        print(f"study {name}: {spec.n_trials} trials, {spec.n_jobs} at once, in {url}",
              file=out, flush=True)
        if kind == "slurm":
            from hpc_ddp.sweep.workers_job import submit  # deferred: the typed schemas

            job = submit(plan.cfg, folder, spec.n_jobs, environ)
            manifest["workers"] = [f"{job}_{i}" for i in range(spec.n_jobs)]
            write_json(folder / studies.STUDY, manifest)
            print(f"workers: job array {job} ({spec.n_jobs} jobs of {plan.cfg.nodes} "
                  f"node(s)); follow with: python -m hpc_ddp.status {folder}", file=out)
            return 0
        return _run_locally(folder, spec.n_jobs, out, environ)


def _run_locally(folder: Path, n_jobs: int, out: TextIO, environ: Mapping[str, str]) -> int:
    """``n_jobs`` worker processes here, their lines passed on as they come."""
    procs = [subprocess.Popen([sys.executable, "-m", "hpc_ddp.sweep.worker", str(folder),
                               str(i)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=dict(environ), cwd=os.getcwd())
             for i in range(n_jobs)]

    def relay(i: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"[worker {i}] {line.rstrip()}", file=out, flush=True)

    threads = [threading.Thread(target=relay, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for thread in threads:
        thread.start()
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:  # each worker's trial checkpoints and stays its own
        for proc in procs:
            proc.terminate()
        codes = [p.wait() for p in procs]
        print(f"interrupted; continue the study with the same command and "
              f"sweep.dir={folder}", file=out)
        return 130
    for thread in threads:
        thread.join(timeout=5)
    print(results(folder), file=out)
    return 0 if all(c == 0 for c in codes) else 1


def results(folder: Path) -> str:
    """The study's trials and its best, as text."""
    manifest = studies.read_study(folder)
    if manifest is None:
        return f"{folder}: no study"
    spec = studies.StudySpec.from_json(manifest["spec"])
    space = studies.space_of(spec, manifest["overrides"])
    study = studies.open_study(spec, manifest["storage"], manifest["study_name"], space,
                               create=False)
    lines = [f"study {manifest['study_name']} ({folder}):"]
    for trial in study.trials:
        values = ", ".join(f"{v:.6g}" for v in trial.values or [])
        params = " ".join(f"{k}={v}" for k, v in trial.params.items())
        lines.append(f"  trial {trial.number:3d}  {trial.state.name:8s} {values:>12s}  {params}")
    lines += best_lines(folder, spec.objective, best_of(study, spec.direction), so_far=False)
    return "\n".join(lines)

