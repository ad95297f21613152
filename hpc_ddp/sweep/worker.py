"""A worker of an adaptive sweep: draws a trial the moment it is free, runs it, reports it.

    python -m hpc_ddp.sweep.worker <sweep folder> <worker index>

``n_jobs`` workers run at once, each on its own (locally: a process each; on Slurm: a job
of the trials' nodes each, whose batch script runs this). A worker draws the next trial
from the study (one at a time under a lock, so the study never passes ``n_trials``), runs
it as a full hpc_ddp run in ``<folder>/trial-<n>`` (on Slurm: a step of the worker's own
allocation, no queue wait between trials), and tells the study its objective, or that it
failed or was pruned. A worker started again (its job requeued at the time limit or after a
preemption) first resumes the trial it had, from that trial's checkpoint: the same trial,
not a new one. No worker waits for another: there are no batches.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from hpc_ddp.errors import UserError
from hpc_ddp.rank.contract import PRUNED_FILE, TRIAL_ENV
from hpc_ddp.rundir import RunDir, read_json, write_json
from hpc_ddp.sweep import orphans
from hpc_ddp.sweep import study as studies
from hpc_ddp.sweep.space import trial_overrides as with_values
from hpc_ddp.sweep.study import trial_dir

OBJECTIVE_FILE = "objective.json"  # a script's value, in its run dir
# Set by ``python -m hpc_ddp.bench search`` alone: its workers draw in batches of n_jobs, each
# waiting for the slowest trial of the last (the Optuna sweeper plugin's way), to compare.
BATCHES_ENV = "HPC_DDP_SWEEP_BATCHES"


class TrialStopped(Exception):
    """The trial's run stopped with a checkpoint (the time limit ahead, a preemption,
    Ctrl-C): the worker leaves it RUNNING, its own, to resume when it starts again."""

    def __init__(self, number: int, run_dir: Path) -> None:
        super().__init__(f"trial {number} stopped with its checkpoint ({run_dir})")
        self.number = number


def _stopped(run_dir: Path, since: float) -> bool:
    """The trial's run stopped with a checkpoint in this attempt (a stop recorded by an
    earlier one says nothing of an attempt that failed since)."""
    from hpc_ddp import events  # deferred (start-up): events

    found = events.read(run_dir)
    return (bool(found) and found[-1].get("kind") == events.STOP
            and float(found[-1].get("time") or 0.0) >= since)


def worker_file(folder: Path, index: int) -> Path:
    return folder / "workers" / f"{index}.json"


def in_allocation(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID"))


def trial_overrides(space: studies.Space, params: Mapping[str, Any], run_dir: Path,
                    environ: Mapping[str, str], resume: bool) -> list[str]:
    """The trial's overrides: the fixed ones and its values; inside a worker's Slurm
    allocation the trial runs as a step of it (cluster=step), never as a new job."""
    given = with_values(space, params)
    if in_allocation(environ):
        given = [o for o in given if not o.startswith("cluster=")] + ["cluster=step"]
    return [*given, f"run_dir={run_dir}", *(["resume=true"] if resume else [])]


def run(folder: Path, index: int, environ: MutableMapping[str, str]) -> int:
    """Draw and run trials until the study has ``n_trials``; the number this worker ran."""
    manifest = studies.read_study(folder)
    if manifest is None:
        raise UserError("sweep folder", str(folder), f"holds no {studies.STUDY}.",
                        "give the folder an adaptive sweep printed when it started.")
    spec = studies.StudySpec.from_json(manifest["spec"])
    space = studies.space_of(spec, manifest["overrides"])
    # Its own random stream: worker index and start (a requeued worker draws anew).
    restart = environ.get("SLURM_RESTART_COUNT", "0")
    stream = 1 + index + 1000 * (int(restart) if restart.isdigit() else 0)
    study = studies.open_study(spec, manifest["storage"], manifest["study_name"], space,
                               create=False, stream=stream)
    mine = worker_file(folder, index)
    # Who this worker is (sweep/orphans.py) and since when (bench search's node-seconds).
    me = {**orphans.identity(environ), "began": time.time()}
    ran = 0
    while (drawn := _next(study, spec, space, folder, mine, me, environ)) is not None:
        number, params, resume = drawn
        _run_trial(study, spec, manifest, space, folder, number, params, resume, environ)
        write_json(mine, {"trial": None, "ran": ran + 1, "time": time.time(), **me})
        ran += 1
    write_json(mine, {**(orphans.read_worker_file(mine, folder) or {}), "ended": time.time()})
    return ran


def _next(study: Any, spec: studies.StudySpec, space: studies.Space, folder: Path,
          mine: Path, me: dict[str, Any], environ: Mapping[str, str]
          ) -> tuple[int, dict[str, Any], bool] | None:
    """This worker's unfinished trial (after a requeue), else one whose worker is gone for
    good (sweep/orphans.py), else a new one; None when the study has all its trials."""
    import optuna  # deferred: optuna

    had = orphans.read_worker_file(mine, folder) or {}
    if isinstance(had.get("trial"), int):
        frozen = study.trials[had["trial"]]
        if frozen.state == optuna.trial.TrialState.RUNNING:
            write_json(mine, {**had, "time": time.time(), **me})
            return had["trial"], dict(frozen.params), True
    while environ.get(BATCHES_ENV) == "1" and _batch_open(study, spec.n_jobs):
        time.sleep(0.5)  # the plugin's batches, for bench search's comparison only
    with studies.locked(folder):
        running = {t.number for t in study.get_trials(
            deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
        found = orphans.orphan(folder, mine, running, environ) if running else None
        if found is not None:
            number, theirs, record = found
            write_json(theirs, {**record, "trial": None, "taken_by": mine.stem})
            write_json(mine, {"trial": number, "time": time.time(), **me})
            print(f"trial {number}: its worker ({record.get('job') or record.get('pid')}) "
                  "is gone; resumed here from its checkpoint", flush=True)
            return number, dict(study.trials[number].params), True
        if studies.drawn_all(study, spec, space):
            return None
        trial = study.ask(space.params)
        write_json(mine, {"trial": trial.number, "time": time.time(), **me})
    return trial.number, dict(trial.params), False


def _batch_open(study: Any, n_jobs: int) -> bool:
    """The next trial would start a new batch of ``n_jobs`` while the last one runs."""
    import optuna  # deferred: optuna

    trials = study.get_trials(deepcopy=False)
    return (len(trials) % n_jobs == 0
            and any(t.state == optuna.trial.TrialState.RUNNING for t in trials))


def _run_trial(study: Any, spec: studies.StudySpec, manifest: Mapping[str, Any],
               space: studies.Space, folder: Path, number: int, params: Mapping[str, Any],
               resume: bool, environ: MutableMapping[str, str]) -> None:
    import optuna  # deferred: optuna

    run_dir = trial_dir(folder, number)
    label = " ".join(f"{k}={v}" for k, v in params.items())
    print(f"trial {number}: {label} -> {run_dir}", flush=True)
    summary = read_json(run_dir / "summary.json") if resume else None
    if not isinstance(summary, dict):  # not finished before the worker stopped: run it
        # TensorBoard's HPARAMS tab compares the trials (as a grid sweep's points).
        write_json(RunDir(run_dir).hparams, {k: v if isinstance(v, int | float | str | bool)
                                             else str(v) for k, v in params.items()})
        # Resumed only where an attempt got as far as its config (a worker stopped between
        # drawing the trial and starting it left nothing to resume).
        started = resume and (run_dir / "config.yaml").exists()
        overrides = trial_overrides(space, params, run_dir, environ, started)
        began = time.time()
        summary = _train(number, overrides, manifest, spec, environ)
        if summary is None and _stopped(run_dir, began):
            raise TrialStopped(number, run_dir)
        if summary is None:
            studies.tell(study, number, state=optuna.trial.TrialState.FAIL)
            return
    result = summary.get("result")
    if not result:  # a script's own way, with no import of ours (docs/sweeps.md)
        result = _written_objective(run_dir)
    pruned = read_json(run_dir / PRUNED_FILE)
    if isinstance(pruned, dict):
        print(f"trial {number}: pruned at step {pruned.get('step')}", flush=True)
        studies.tell(study, number, state=optuna.trial.TrialState.PRUNED)
        return
    values, said = studies.objective_values(spec, summary, result)
    if values is None:
        print(f"trial {number}: {said}", flush=True)
        studies.tell(study, number, state=optuna.trial.TrialState.FAIL)
        return
    print(f"trial {number}: {said}", flush=True)
    studies.tell(study, number, values if len(values) > 1 else values[0])


def _written_objective(run_dir: Path) -> Any:
    """What a trial's script wrote to ``$HPC_DDP_RUN_DIR/objective.json`` (a number, or a
    dict of metric -> value), read only as a file of this user's run dir (owned.py)."""
    from hpc_ddp.owned import Untrusted, read_owned  # deferred (start-up): owned

    try:
        return json.loads(read_owned(run_dir / OBJECTIVE_FILE, run_dir))
    except FileNotFoundError:
        return None
    except (Untrusted, ValueError, OSError) as exc:
        print(f"{run_dir / OBJECTIVE_FILE} is not read: {exc}", flush=True)
        return None


def _train(number: int, overrides: list[str], manifest: Mapping[str, Any],
           spec: studies.StudySpec, environ: MutableMapping[str, str]) -> dict[str, Any] | None:
    """Run the trial to its end; its summary, or None when it failed (said why)."""
    from hpc_ddp import api  # deferred: the typed schemas

    # Rank 0 reports each evaluation to the trial, and stops it when the pruner says so.
    environ[TRIAL_ENV] = json.dumps({"folder": manifest["folder"], "trial": number,
                                     "objective": spec.objective[0]})
    run = None
    try:
        plan = api.plan(overrides, Path(manifest["cwd"]), environ)
        run = api.submit(plan)
        return run.wait(progress=False)
    except (UserError, api.RunFailed) as exc:
        print(f"trial {number}: FAILED: {str(exc).splitlines()[0]}", flush=True)
        return None
    except KeyboardInterrupt:  # the worker was stopped (SIGTERM): the trial checkpoints
        if run is not None:
            run.cancel(grace_s=60.0)
        raise
    finally:
        environ.pop(TRIAL_ENV, None)


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m hpc_ddp.sweep.worker <sweep folder> <worker index>",
              file=sys.stderr)
        return 2
    # SIGTERM (Ctrl-C of a local study, scancel, a preemption): the running trial stops
    # with a checkpoint and stays this worker's, RUNNING, for the next start to resume.
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        ran = run(Path(argv[0]).absolute(), int(argv[1]), os.environ)
    except KeyboardInterrupt:
        print(f"worker {argv[1]}: stopped; its trial resumes when the sweep starts again",
              flush=True)
        return 130
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except TrialStopped as stopped:
        return _after_stop(stopped, os.environ)
    print(f"worker {argv[1]}: done after {ran} trial(s)", flush=True)
    from hpc_ddp.sweep import study_plot  # deferred (start-up): sweep.study_plot

    try:  # the picture is extra: a worker that ran its trials ends well without it
        drawn = study_plot.write(Path(argv[0]).absolute())
    except (OSError, UserError, ValueError) as exc:
        print(f"worker {argv[1]}: the study's picture was not drawn: {exc}", flush=True)
        return 0
    if drawn is not None:
        print(f"worker {argv[1]}: the study drawn in {drawn}", flush=True)
    return 0


def _after_stop(stopped: TrialStopped, environ: Mapping[str, str]) -> int:
    """A worker on Slurm requeues its own job (the restarted worker resumes the trial from
    its checkpoint); elsewhere it ends, and the same sweep command resumes the trial."""
    from hpc_ddp.slurm import requeue  # deferred (start-up): slurm.requeue

    job = environ.get("SLURM_JOB_ID")
    if job:
        problem = requeue.requeue(job, environ)
        print(f"{stopped}; " + (f"requeueing job {job} failed: {problem}" if problem
                                else f"job {job} requeued to resume it"), flush=True)
        return 1 if problem else 0
    print(f"{stopped}; run the same sweep command to resume it", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
