"""The same adaptive search three ways: in batches of ``n_jobs`` without pruning (the Optuna
sweeper plugin's way), asynchronously without pruning, and asynchronously with pruning.

    python -m hpc_ddp.bench search cluster=slurm nodes=1 'optim.lr=choice(0.01, 0.1, 1000)' \\
        hydra.sweeper.sampler=grid hydra.sweeper.n_jobs=3 hydra.sweeper.pruner=median

Give it the overrides of the search (the space, ``hydra.sweeper.*``, the trial's own); each
way runs it as ``python -m hpc_ddp.submit -m hydra/sweeper=optuna ...`` in a folder of its
own under ``--out``, one way after another (the first two without the pruner; the third with
the one given, ``median`` when none is). On Slurm it waits for each way's workers to end.
Printed and written to ``<out>/search.json``, per way (bench/search_figures.py): node-seconds
the workers held, the share of them idle between trials, the best value, and node-seconds
held until a trial first reached the batched way's final best. A grid sampler (the same
points in the same order every way) makes the three comparable; a random one compares
different searches. docs/sweeps.md#adaptive-sweeps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.bench import search_figures
from hpc_ddp.bench.search_figures import Trial, WayFigures
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.rundir import read_json, write_json

WAYS = ("batched (the plugin)", "asynchronous", "asynchronous, pruned")
_PRUNER = "hydra.sweeper.pruner"


def way_overrides(given: Sequence[str], way: int, folder: Path) -> list[str]:
    """The submit overrides of way ``way`` (0, 1, 2) of the search ``given`` (pure)."""
    pruning = [o for o in given if o.lstrip("+").startswith(_PRUNER)]
    rest = [o for o in given if o not in pruning and o.replace(" ", "") not in (
        "hydra/sweeper=optuna", "-m", "--multirun")]
    if way == 2:
        rest += pruning or [f"{_PRUNER}=median"]
    return ["-m", "hydra/sweeper=optuna", *rest, f"sweep.dir={folder}"]


def _run_way(given: Sequence[str], way: int, folder: Path) -> None:
    from hpc_ddp.sweep.worker import BATCHES_ENV  # deferred (start-up): sweep.worker

    env = {**os.environ, **({BATCHES_ENV: "1"} if way == 0 else {})}
    began = time.monotonic()
    print(f"{WAYS[way]}: starting ({folder})", flush=True)
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.submit",
                           *way_overrides(given, way, folder)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise UserError("search", " ".join(given), "did not run: "
                        + (done.stderr.strip() or done.stdout.strip())[-800:],
                        "run it once with python -m hpc_ddp.submit -m hydra/sweeper=optuna "
                        "... and fix what it says.")
    workers = (read_json(folder / "study.json") or {}).get("workers") or []
    if workers:  # on Slurm: the command returned once the array was queued
        array = str(workers[0]).split("_")[0]
        while _queued(array):
            time.sleep(2.0)
    print(f"{WAYS[way]}: done in {time.monotonic() - began:.0f} s", flush=True)


def _queued(array: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", array, "-o", "%i"], capture_output=True,
                         text=True, check=False)
    return out.returncode == 0 and bool(out.stdout.strip())


def _read(folder: Path) -> tuple[list[Trial], list[tuple[float, float]], int, bool]:
    """The way's trials, its workers' (start, end), nodes per worker, and minimize."""
    from hpc_ddp.sweep import study as studies  # deferred (start-up): sweep.study

    manifest = studies.read_study(folder)
    if manifest is None:
        raise UserError("search", str(folder), "left no study.", "see the workers' output.")
    spec = studies.StudySpec.from_json(manifest["spec"])
    space = studies.space_of(spec, manifest["overrides"])
    study = studies.open_study(spec, manifest["storage"], manifest["study_name"], space,
                               create=False)
    trials = [Trial(t.number, t.datetime_start.timestamp() if t.datetime_start else 0.0,
                    t.datetime_complete.timestamp() if t.datetime_complete else 0.0,
                    t.values[0] if t.values else None, t.state.name) for t in study.trials]
    workers = []
    for path in sorted((folder / "workers").glob("*.json")):
        record = read_json(path) or {}
        if isinstance(record.get("began"), float) and isinstance(record.get("ended"), float):
            workers.append((record["began"], record["ended"]))
    nodes = int((read_json(folder / "trial-0" / "summary.json") or {}).get("num_nodes") or 1)
    return trials, workers, nodes, spec.direction[0] == "minimize"


def compare(folders: Sequence[Path]) -> tuple[list[WayFigures], float | None]:
    """Each way's figures against the first's final best."""
    read = [_read(f) for f in folders]
    trials, _, _, minimize = read[0]
    target = search_figures.best_of(trials, minimize)
    rows = [search_figures.figures(WAYS[i], t, w, n, m, target)
            for i, (t, w, n, m) in enumerate(read)]
    return rows, target


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpc_ddp.bench search",
        description="The same adaptive search in batches, asynchronously, and pruned.")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of the three studies and search.json "
                             "(default outputs/bench-search-<time>)")
    options, given = parser.parse_known_args(list(argv))
    unknown = [a for a in given if a.startswith("-") and a not in ("-m", "--multirun")]
    if unknown:
        print(f"error: {unknown[0]} is not an option of bench search. Fix: give the search's "
              "overrides (key=value) and --out.", file=sys.stderr)
        return USAGE_EXIT_CODE
    out = (options.out or Path("outputs") / time.strftime("bench-search-%Y%m%d_%H%M%S"))
    out = out.absolute()
    folders = [out / name for name in ("batched", "async", "pruned")]
    try:
        for way, folder in enumerate(folders):
            _run_way(given, way, folder)
        rows, target = compare(folders)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    print(search_figures.table(rows, target))
    result: dict[str, Any] = {"overrides": list(given), "target": target,
                              "ways": [r.as_dict() for r in rows]}
    write_json(out / "search.json", result)
    print(f"written: {out / 'search.json'}")
    return 0
