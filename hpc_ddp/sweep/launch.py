"""Submit a sweep: every point a full (multi-node) DDP run with its own run dir.

On Slurm the points go out as job arrays — one sbatch per array, split to fit the cluster's
MaxArraySize (or sweep.max_array_size) — and the command returns at once. Each array task
is its own Slurm job (its own SLURM_JOB_ID: its own rendezvous, its own requeue). Without
Slurm the points run here, ``sweep.parallel`` at a time. Either way a manifest
(``<sweep dir>/sweep.json``) lists point -> overrides, job id, run dir, for ``hpc_ddp.status``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp import api
from hpc_ddp.config import secrets
from hpc_ddp.config.compose import to_yaml
from hpc_ddp.errors import PointError, UserError
from hpc_ddp.launch import interrupts
from hpc_ddp.launch.interrupts import exit_code
from hpc_ddp.rundir import created_with, read_json, resume_command, write_json
from hpc_ddp.sweep import arrays
from hpc_ddp.sweep.arrays import MANIFEST, count
from hpc_ddp.sweep.expand import Point, expand
from hpc_ddp.sweep.folder import sweep_dir_for
from hpc_ddp.sweep.study import is_adaptive
from hpc_ddp.sweep.timing import Phases

PREFLIGHT = "preflight"


def plan_points(overrides: Sequence[str], cwd: Path, environ: Mapping[str, str],
                script_args: Sequence[str] | None = None, phases: Phases | None = None
                ) -> tuple[Path, list[Point], list[api.Plan]]:
    """Expand and check every point before anything is submitted (exit 2 names the point)."""
    points = expand(overrides)
    folder = sweep_dir_for(overrides, cwd)
    # A sweep whose preflight failed left only its report: it may be submitted again there.
    if folder.exists() and any(p.name != PREFLIGHT for p in folder.iterdir()):
        raise UserError("sweep.dir", str(folder), "already holds files; nothing is touched.",
                        "choose a new sweep.dir.")
    if folder.exists():
        # deferred (start-up): inputs.run_dir
        from hpc_ddp.inputs.run_dir import check_owned_folder

        check_owned_folder(folder, "sweep.dir", str(folder))
    # Where each point writes, as overrides (--cfg and config.yaml show where it is).
    lists = [[*(o for o in p.overrides if _key(o) not in ("run_dir", "sweep.dir")),
              f"run_dir={folder / f'{p.index:03d}'}", f"sweep.dir={folder}"] for p in points]
    phases = phases or Phases()
    try:  # the config pipeline (hpc_ddp/planning.py), its secrets one environment's
        plans = api.plan_many(lists, cwd, environ, script_args=script_args, timed=phases.timed)
    except PointError as exc:
        point = points[exc.index]
        raise UserError(exc.key, exc.value, f"(sweep point {point.index}: {point.label()}) "
                        f"{exc.problem}", exc.fix) from None
    kinds = {p.cfg.cluster.kind for p in plans}
    if len(kinds) > 1:
        raise UserError("cluster", "/".join(sorted(kinds)), "differs between sweep points.",
                        "sweep within one cluster kind.")
    for name, value in (("sweep.max_array_size", plans[0].cfg.sweep.max_array_size),
                        ("sweep.parallel", plans[0].cfg.sweep.parallel)):
        if value is not None and value < 1:
            raise UserError(name, value, "must be >= 1.", f"set {name}=1 or more, or null.")
    return folder, points, plans


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def launch(overrides: Sequence[str], out: TextIO, cwd: Path | None = None,
           environ: Mapping[str, str] | None = None, show_cfg: bool = False,
           script_args: Sequence[str] | None = None) -> int:
    """The multirun command: plan, write the manifest, submit; 0 when every point went out.

    ``show_cfg`` (--cfg) and ``dry_run=true`` print each point's config or what would be
    submitted, and ``preflight=true`` runs the doctor once per job shape before anything
    goes out; none of them submits anything it should not.
    """
    environ = os.environ if environ is None else environ
    if is_adaptive(overrides):  # hydra/sweeper=optuna: a study and its workers
        from hpc_ddp.sweep import adaptive  # deferred (start-up): sweep.adaptive

        return adaptive.launch(overrides, out, cwd or Path.cwd(), environ)
    phases = Phases()
    folder, points, plans = plan_points(overrides, cwd or Path.cwd(), environ, script_args,
                                        phases)
    if show_cfg or plans[0].cfg.dry_run:
        print(_dry_run(points, plans, folder, environ, show_cfg), file=out)
        return 0
    kind = plans[0].cfg.cluster.kind
    if kind == "slurm":
        # deferred: hostlist; start-up: slurm.fit
        from hpc_ddp.launch.slurm import check_client
        from hpc_ddp.slurm.fit import check

        check_client(environ)
        # One sinfo for the whole sweep: a point no node can run is refused before any is sent.
        check([p.cfg for p in plans], environ, [f"{p.index}: {p.label()}" for p in points])
    if plans[0].cfg.preflight and not _preflight(plans, folder, out):
        print(f"error: the preflight checks failed (above); nothing was submitted. Their "
              f"report is in {folder / PREFLIGHT}; the same sweep.dir may be used again.",
              file=sys.stderr)
        return 1
    with created_with(plans[0].cfg.cluster.umask):  # the sweep dir and every run dir in it
        return _write_and_submit(overrides, out, environ, kind, folder, points, plans, phases)


def _write_and_submit(overrides: Sequence[str], out: TextIO, environ: Mapping[str, str],
                      kind: str, folder: Path, points: list[Point], plans: list[api.Plan],
                      phases: Phases) -> int:
    """The sweep dir, its manifest and the points' folders, then the submission."""
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    marks = secrets.marks_of(plans[0].cfg)
    manifest: dict[str, Any] = {"kind": kind, "created": time.time(),
                                "overrides": secrets.scrub_overrides(overrides, marks),
                                "arrays": [], "points": [
        {"index": p.index, "label": p.label(), "params": dict(p.params),
         "overrides": secrets.scrub_overrides(p.overrides, marks),
         "run_dir": str(plan.run_dir.root), "job_id": None}
        for p, plan in zip(points, plans, strict=True)]}
    with phases.timed("folders"):
        for point, plan in zip(points, plans, strict=True):
            plan.run_dir.root.mkdir(parents=True, exist_ok=True)
            write_json(plan.run_dir.hparams, dict(point.params))
        write_json(folder / MANIFEST, manifest)
    if kind == "slurm":
        try:
            arrays.submit_arrays(manifest, plans, folder, environ, phases)
        except KeyboardInterrupt as exc:  # between two arrays: what went out stays out
            return arrays.stopped_submitting(manifest, folder, created, exc, out)
        except BaseException:
            if created and all(p["job_id"] is None for p in manifest["points"]):
                shutil.rmtree(folder, ignore_errors=True)  # nothing went out: leave nothing
            else:  # what went out before a refusal stays findable by hpc_ddp.status
                write_json(folder / MANIFEST, manifest)
            raise
        write_json(folder / MANIFEST, manifest)
        phases.write(environ, len(points))
        print(table(manifest, folder), file=out)
        print(f"{count(len(points), 'point')} in {len(manifest['arrays'])} job array(s); "
              "follow with: "
              f"python -m hpc_ddp.status {folder} --watch", file=out)
        return 0
    return _run_locally(manifest, plans, folder, out)


def _dry_run(points: list[Point], plans: list[api.Plan], folder: Path,
             environ: Mapping[str, str], show_cfg: bool) -> str:
    """Each point's config (--cfg), or the sbatch script of every array (dry_run=true)."""
    if show_cfg:
        return "\n".join(f"# point {p.index}: {p.label()}\n{to_yaml(plan.cfg)}"
                         for p, plan in zip(points, plans, strict=True))
    if plans[0].cfg.cluster.kind != "slurm":
        lines = [f"would run {count(len(plans), 'point')} here, "
                 f"{plans[0].cfg.sweep.parallel or 1} at "
                 f"a time, into {folder}; nothing was started."]
        lines += [f"  point {p.index}: {p.label()} -> {plan.run_dir.root}"
                  for p, plan in zip(points, plans, strict=True)]
        return "\n".join(lines)
    # deferred: hostlist
    from hpc_ddp.launch.slurm import submission_text

    scripts = []
    existed = folder.exists()
    try:
        for indices, executor in arrays.arrays(plans, folder, environ):
            executor.parameters["map_count"] = len(indices)  # what submitit's batch sets
            labels = ", ".join(f"{i}: {points[i].label()}" for i in indices)
            scripts.append(f"# array of points {labels}\n" + submission_text(executor, "dry"))
    finally:
        if not existed:  # submitit's executor makes its folder; a dry run leaves none
            shutil.rmtree(folder, ignore_errors=True)
    return "\n".join(scripts) + f"\n# {count(len(plans), 'point')} in {len(scripts)} job " \
        "array(s); nothing was submitted."


def _preflight(plans: list[api.Plan], folder: Path, out: TextIO) -> bool:
    """The doctor once per job shape (the first point of each group), before any submission."""
    # deferred: hostlist
    from hpc_ddp.doctor import preflight

    firsts = [g[0] for g in arrays.groups(plans)] if plans[0].cfg.cluster.kind == "slurm" else [0]
    return all([preflight(plans[i].cfg, folder, out) for i in firsts])


def _run_locally(manifest: dict[str, Any], plans: list[api.Plan], folder: Path,
                 out: TextIO) -> int:
    """Local sweep: sweep.parallel points at a time, each a full local DDP run."""
    parallel = plans[0].cfg.sweep.parallel or 1
    waiting = list(range(len(plans)))
    running: list[tuple[int, api.Run]] = []
    try:
        failed = _run_points(manifest, plans, folder, out, parallel, waiting, running)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP (launch/interrupts.py)
        _interrupted(manifest, running, waiting, out)
        return exit_code(exc)
    print(table(manifest, folder), file=out)
    return 1 if failed else 0


def _interrupted(manifest: dict[str, Any], running: list[tuple[int, api.Run]],
                 waiting: list[int], out: TextIO) -> None:
    """Ctrl-C in a local sweep: the running points checkpoint and stop (all at once); the
    commands that continue them and run the others are printed."""
    # deferred: concurrent
    from concurrent.futures import ThreadPoolExecutor

    print(f"\ninterrupted: {len(running)} running point(s) save a checkpoint and stop; "
          f"{len(waiting)} not started...", file=out, flush=True)
    with ThreadPoolExecutor(max(1, len(running))) as pool:
        list(pool.map(lambda item: item[1].cancel(grace_s=120.0), running))
    for i, run in running:
        print(f"point {i}: stopped; continue it with: {resume_command(run.run_dir)}", file=out)
    for i in waiting:
        point = manifest["points"][i]
        given = " ".join(shlex.quote(o) for o in point["overrides"]
                         if not o.startswith("sweep."))
        print(f"point {i}: not started; run it with: python -m hpc_ddp.submit {given} "
              f"{shlex.quote('run_dir=' + point['run_dir'])}", file=out)


def _run_points(manifest: dict[str, Any], plans: list[api.Plan], folder: Path, out: TextIO,
                parallel: int, waiting: list[int], running: list[tuple[int, api.Run]]) -> int:
    """Start and collect points until none is left; the number that failed."""
    failed = 0
    shown: dict[int, float] = {}  # point -> when its progress was last printed
    while waiting or running:
        _show_progress(running, shown, out)
        while waiting and len(running) < parallel:
            with interrupts.held():  # a point that went out is stopped with the others
                i = waiting.pop(0)
                run = api.submit(plans[i])
                running.append((i, run))
                manifest["points"][i]["job_id"] = run.job_id
                write_json(folder / MANIFEST, manifest)
                print(f"point {i}: {manifest['points'][i]['label']} -> job {run.job_id}",
                      file=out, flush=True)
        for i, run in list(running):
            if run.done():
                running.remove((i, run))
                ok = run.state == "COMPLETED"
                failed += not ok
                summary = run.summary() or {}
                # deferred: hostlist
                from hpc_ddp.rank.supervise.outcome import summary_line

                print(f"point {i}: {'done' if ok else 'FAILED'}"
                      + (f"  {summary_line(summary)}" if summary else ""), file=out, flush=True)
        time.sleep(0.5)
    return failed


def _show_progress(running: list[tuple[int, api.Run]], shown: dict[int, float], out: TextIO,
                   every_s: float = 10.0) -> None:
    """A line per running point every ``every_s``: its step, loss and speed."""
    now = time.monotonic()
    for i, run in running:
        progress = read_json(run.files.progress)
        if not progress or now - shown.get(i, 0.0) < every_s:
            continue
        shown[i] = now
        print(f"point {i}: {progress_line(progress)}", file=out, flush=True)


def progress_line(progress: dict[str, Any]) -> str:
    """"step 40/64  loss 1.3086  16320 samples/s  epoch 1" (what is known of it: no total for a
    loop that gave none); a stop's: "stopped at step 520 of 100000, checkpoint saved"."""
    # deferred (start-up): follow
    from hpc_ddp.watch.follow import progress_text

    total = progress.get("total_steps")
    if progress.get("stopped"):
        return (f"stopped at step {progress.get('step')}" + (f" of {total}" if total else "")
                + ", checkpoint saved")
    return f"step {progress.get('step')}" + (f"/{total}" if total else "") + (
        f"  {progress_text(progress)}" if progress_text(progress) else "")


def table(manifest: dict[str, Any], folder: Path) -> str:
    rows = [("point", "overrides", "job id", "run dir")] + [
        (str(p["index"]), p["label"], str(p["job_id"]), str(Path(p["run_dir"]).relative_to(folder)))
        for p in manifest["points"]]
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    lines = ["  ".join(cell.ljust(widths[c]) for c, cell in enumerate(r)) for r in rows]
    return f"sweep {folder}\n" + "\n".join(lines)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    data = read_json(folder / MANIFEST)
    return data if isinstance(data, dict) else None
