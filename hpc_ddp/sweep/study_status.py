"""``python -m hpc_ddp.status <sweep dir>`` for an adaptive sweep: the study's trials, its
best so far and its workers; ``--cancel`` stops every worker.

One read of the study's storage and, on Slurm, one ``squeue`` for the workers' array.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.rundir import read_json
from hpc_ddp.sweep import study as studies
from hpc_ddp.sweep.study import trial_dir


def is_study(path: Path) -> bool:
    return (path / studies.STUDY).is_file()


def best_of(study: Any, directions: Sequence[str]) -> list[Any]:
    """The best trial (one objective) or the best trade-offs (several: the Pareto front,
    Optuna's ``best_trials``); empty while no trial has completed."""
    if len(directions) == 1:
        try:
            return [study.best_trial]
        except ValueError:  # nothing completed yet
            return []
    return sorted(study.best_trials, key=lambda t: t.number)


def best_lines(folder: Path, objective: Sequence[str], best: Sequence[Any],
               so_far: bool = True) -> list[str]:
    """What the best trial, or each trial of the front, scored and where its run dir is."""
    when = " so far" if so_far else ""
    if not best:
        return []
    scores = [f"trial {t.number} ({', '.join(objective)} = "
              f"{', '.join(f'{v:.6g}' for v in t.values)}): {trial_dir(folder, t.number)}"
              for t in best]
    if len(objective) == 1:
        return [f"best{when}: {scores[0]}"]
    return [f"best trade-offs{when} (the Pareto front of {', '.join(objective)}, "
            f"{len(best)} trial(s)):", *(f"  {line}" for line in scores)]


def rows(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[Any]]:
    """(manifest, a row per trial, the best trial or the front: :func:`best_of`)."""
    manifest = studies.read_study(folder)
    assert manifest is not None  # is_study found it
    spec = studies.StudySpec.from_json(manifest["spec"])
    study = studies.open_study(spec, manifest["storage"], manifest["study_name"],
                               studies.space_of(spec, manifest["overrides"]), create=False)
    found = [{"trial": t.number, "state": t.state.name, "values": t.values,
              "params": t.params, "run_dir": str(trial_dir(folder, t.number)),
              "pruned_at": (read_json(trial_dir(folder, t.number) / "pruned.json") or {}
                            ).get("step")} for t in study.trials]
    return manifest, found, best_of(study, spec.direction)


def workers_state(manifest: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """Worker job id -> its state (one squeue for the array); empty for a local study."""
    if not manifest.get("workers"):
        return {}
    array = str(manifest["workers"][0]).split("_")[0]
    try:
        done = subprocess.run(["squeue", "-h", "-r", "-j", array, "-o", "%i %T"],
                              env=dict(environ), capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    return {w: found.get(w, "ended") for w in manifest["workers"]}


def show(folder: Path, out: TextIO, environ: Mapping[str, str], as_json: bool = False,
         plot: Path | None = None) -> int:
    """The study's state; ``plot``: its picture there too (sweep/study_plot.py)."""
    manifest, found, best = rows(folder)
    if plot is not None:
        from hpc_ddp.sweep import study_plot  # deferred (start-up): sweep.study_plot

        drawn = study_plot.write(folder, plot.absolute())
        print(f"plot written to {drawn}" if drawn else "plot: no trial has a value yet",
              file=out)
    workers = workers_state(manifest, environ)
    spec = manifest["spec"]
    if as_json:
        print(json.dumps({"study": manifest["study_name"], "trials": found, "workers": workers,
                          "best": best[0].number if len(best) == 1 and len(
                              spec["direction"]) == 1 else None,
                          "front": [t.number for t in best]}, indent=2), file=out)
        return 0
    states = [r["state"] for r in found]
    print(f"study {manifest['study_name']} ({folder}): {len(found)} of {spec['n_trials']} "
          f"trials drawn, {states.count('COMPLETE')} complete, {states.count('PRUNED')} "
          f"pruned, {states.count('FAIL')} failed, {states.count('RUNNING')} running",
          file=out)
    for r in found:
        values = ", ".join(f"{v:.6g}" for v in r["values"] or [])
        note = f"pruned at step {r['pruned_at']}" if r["pruned_at"] is not None else values
        params = " ".join(f"{k}={v}" for k, v in r["params"].items())
        print(f"  trial {r['trial']:3d}  {r['state']:8s} {note:>22s}  {params}", file=out)
    for line in best_lines(folder, spec["objective"], best):
        print(line, file=out)
    if workers:
        print("workers: " + ", ".join(f"{w} {s}" for w, s in workers.items()), file=out)
    return 0


def cancel(folder: Path, out: TextIO, environ: Mapping[str, str]) -> int:
    """Cancel every worker (their trials' ranks checkpoint on Slurm's SIGTERM) and mark the
    trials they were running FAILED: none stays RUNNING for ever."""
    import optuna  # deferred: optuna

    manifest, found, _ = rows(folder)
    workers = workers_state(manifest, environ)
    live = sorted({w.split("_")[0] for w, s in workers.items() if s != "ended"})
    if live:
        subprocess.run(["scancel", *live], env=dict(environ), check=False, timeout=60)
    spec = studies.StudySpec.from_json(manifest["spec"])
    study = studies.open_study(spec, manifest["storage"], manifest["study_name"],
                               studies.space_of(spec, manifest["overrides"]), create=False)
    running = [r["trial"] for r in found if r["state"] == "RUNNING"]
    for number in running:
        studies.tell(study, number, state=optuna.trial.TrialState.FAIL)
    print((f"cancelled the workers' job array {', '.join(live)}" if live
           else "no worker was running") + (f"; trial(s) {', '.join(map(str, running))} "
                                            "marked FAILED (their checkpoints stay in their "
                                            "run dirs)" if running else ""), file=out)
    return 0
