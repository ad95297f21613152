"""The state of a run or a whole sweep: ``python -m hpc_ddp.status <run_dir | sweep_dir>``.

    python -m hpc_ddp.status multirun/2026-11-30_10-00-00            # a table, the best point
    python -m hpc_ddp.status multirun/2026-11-30_10-00-00 --watch    # refresh until all end
    python -m hpc_ddp.status multirun/2026-11-30_10-00-00 --plot curves.png
    python -m hpc_ddp.status outputs/try1 --cancel                   # cancel a run or a sweep
    python -m hpc_ddp.status outputs/try1 --stop     # stop at an agreed step, checkpointed
    python -m hpc_ddp.status outputs/try1 --json
    python -m hpc_ddp.status 1234          # a job of jobs/train.sbatch, pending or not
    python -m hpc_ddp.status outputs/try1 --watch --interval 30     # refresh every 30 s

Per job: its state in one word (Slurm's pending reason beside a pending job, in words below
the table, with the fix when the job can never start), restarts, current step, latest loss
and eval accuracy. One squeue and at most one sacct call a refresh for a whole sweep.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.api import JOB_FILE, Run
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.launch.control import NOT_SUBMITTED, ended, queried
from hpc_ddp.rundir import RunDir, read_json, resume_command
from hpc_ddp.sweep import study_status
from hpc_ddp.watch.recovery_lines import failure_lines, restarts_cell
from hpc_ddp.watch.sync_lines import percent, status_lines

# Folders the other commands make, which status cannot follow: (their results file, which
# also marks one once written, the name their config.yaml gives the job, what it is).
OTHER_KINDS = (("doctor.json", "hpc_ddp_doctor", "a doctor run (python -m hpc_ddp.doctor)"),
               ("bench/comm.json", "hpc_ddp_bench-comm",
                "a benchmark run (python -m hpc_ddp.bench comm)"),
               ("bench/train.json", "hpc_ddp_bench-train",
                "a benchmark run (python -m hpc_ddp.bench train)"))


def runs_of(path: Path, typed: str | None = None
            ) -> tuple[list[tuple[str, Path]], dict[str, Any] | None]:
    """(label, run dir) of every run under ``path`` (one for a run, all points of a sweep);
    a run dir not made yet, or a job id (``typed``), of a job sbatch started: its run dir.

    Raises UserError for anything else, saying what it is when it can be told."""
    # deferred (start-up): slurm.queued, sweep.launch
    from hpc_ddp.slurm.queued import run_dir_for
    from hpc_ddp.sweep.launch import read_manifest

    shown = str(path)
    if not path.exists():  # a pending job of jobs/train.sbatch: its run dir comes at its start
        where = run_dir_for(path, typed or shown)
        return runs_of(where) if where.is_dir() else ([(where.name, where)], None)
    if not path.is_dir():
        raise UserError("path", shown, "is a file, not a folder.",
                        f"pass a run dir or a sweep dir (this file's folder is {path.parent}).")
    manifest = read_manifest(path)
    if manifest is not None:
        return [(p["label"], Path(p["run_dir"])) for p in manifest["points"]], manifest
    other = other_kind(path)
    if other is not None:
        what, results = other
        raise UserError("path", shown, f"is {what}, not a training run or a sweep.",
                        f"its results are written to {path / results}; status follows the "
                        "runs and sweeps of submit.")
    if (path / JOB_FILE).is_file() or (path / "config.yaml").is_file():
        return [(path.name, path)], None
    raise UserError("path", shown, "is neither a run dir nor a sweep dir (no job.json, "
                    "config.yaml or sweep.json).", "pass the run dir submit printed, or a "
                    "sweep's sweep.dir.")


def other_kind(path: Path) -> tuple[str, str] | None:
    """(what it is, its results file) for a doctor or benchmark folder; None otherwise."""
    job_name = ""
    if (path / "config.yaml").is_file() and not (path / JOB_FILE).is_file():
        # deferred (start-up): config.yaml_guard
        from hpc_ddp.config import yaml_guard

        try:  # its aliases counted first: a planted bomb must not hang a status
            data = yaml_guard.load((path / "config.yaml").read_text(), "config.yaml")
            job_name = str(((data or {}).get("cluster") or {}).get("job_name") or "")
        except Exception:  # an unreadable config.yaml: not this function's to report
            job_name = ""
    for results, name, what in OTHER_KINDS:
        if (path / results).is_file() or job_name == name:
            return what, results
    return None


class Lookups:
    """What a status command keeps between refreshes: the partitions' facts (one sinfo,
    only once a pending reason needs them) and the runs' requests (from config.yaml)."""

    def __init__(self) -> None:
        # deferred (start-up): slurm.fit
        from hpc_ddp.slurm.fit import lazy_partitions

        self.facts = lazy_partitions()
        self.requests: dict[Path, Any] = {}


def rows_of(runs: list[tuple[str, Path]], looks: Lookups | None = None) -> list[dict[str, Any]]:
    """One row per run; the Slurm jobs of all of them asked in one squeue and at most one
    sacct call (a whole sweep, whatever its size)."""
    # deferred (start-up): runcost, slurm.queued, slurm.state
    from hpc_ddp.slurm.queued import KNOWN
    from hpc_ddp.slurm.state import query_with_cost
    from hpc_ddp.watch.runcost import job_ids

    jobs = {run_dir: read_json(run_dir / JOB_FILE) or KNOWN.get(run_dir) for _, run_dir in runs}
    states, costs = query_with_cost(i for j in jobs.values() if queried(j) for i in job_ids(j))
    looks = looks or Lookups()
    return [row(label, run_dir, jobs[run_dir], states, looks, costs) for label, run_dir in runs]


def row(label: str, run_dir: Path, job: dict[str, Any] | None = None,
        states: dict[str, Any] | None = None, looks: Lookups | None = None,
        costs: dict[str, Any] | None = None) -> dict[str, Any]:
    # deferred (start-up): events, runcost, slurm.reasons, slurm.state
    from hpc_ddp import events
    from hpc_ddp.slurm.reasons import pending_of
    from hpc_ddp.slurm.state import JobState
    from hpc_ddp.watch.ended import current_summary  # watch.ended
    from hpc_ddp.watch.runcost import run_cost

    progress = read_json(run_dir / "progress.json") or {}
    job = job if job is not None else read_json(run_dir / JOB_FILE)
    summary = current_summary(run_dir, job)
    pending = None
    if not job:
        found = JobState(NOT_SUBMITTED)
    else:  # the refresh's one query where the kind is asked so (launch/control.py)
        found = Run(run_dir, job).job.state(states)
    if found.state == "PENDING":
        looks = looks or Lookups()
        pending = pending_of(found, run_dir, looks.facts, looks.requests)
    restarts = summary.get("restarts")
    happened = events.read(run_dir)
    recovery = events.recovery(happened)  # what failures cost so far (docs/fault-tolerance.md)
    if found.state == "FAILED" and not recovery["failures"]:
        # Failed before it could record one (joining: a refusal, a bad interface): the
        # first error file says who and why, as the submit command's report does.
        from hpc_ddp.watch.failures import first_failure  # deferred (start-up): failures

        recovery["failures"] = first_failure(RunDir(run_dir))
    if restarts is None:  # the attempt that runs now: resumes so far, requeues, in place
        resumes = len((job or {}).get("history") or [None]) - 1
        restarts = resumes + recovery["requeues"] + recovery["restarts_in_place"]
    return {"label": label, "run_dir": str(run_dir), "job_id": job and job.get("job_id"),
            "state": found.state, "slurm_state": found.raw, "reason": found.reason,
            "pending": pending.line() if pending else None,
            "never": bool(pending and pending.never), "restarts": restarts,
            "step": summary.get("global_step", progress.get("step")),
            "total_steps": summary.get("total_steps", progress.get("total_steps")),
            "loss": summary.get("final_train_loss", progress.get("loss")),
            "eval_accuracy": summary.get("eval_accuracy"),
            "eval_loss": summary.get("eval_loss"),
            # throughput (trainer/throughput.py): the latest logged window's
            "samples_per_s": progress.get("samples_per_s"), "mfu": progress.get("mfu"),
            "step_ms": progress.get("step_ms"), "slowest_rank": progress.get("slowest_rank"),
            "slowest_behind": progress.get("slowest_behind"),
            # gradient sync's share of a step (trainer/sync_probe.py): the attempt's, or while
            # it trains its latest sampled steps'
            "sync_share": summary.get("sync_share", progress.get("sync_share")),
            "cost": run_cost(run_dir, job, found.state, costs or {}), "recovery": recovery}


def best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The point with the highest eval accuracy; without accuracies (a regression, your own
    metrics), the one with the lowest eval loss."""
    scored = [r for r in rows if isinstance(r["eval_accuracy"], int | float)]
    if scored:
        return max(scored, key=lambda r: r["eval_accuracy"])
    losses = [r for r in rows if isinstance(r.get("eval_loss"), int | float)]
    return min(losses, key=lambda r: r["eval_loss"]) if losses else None


def render(rows: list[dict[str, Any]], is_sweep: bool) -> str:
    def fmt(value: Any, spec: str = "") -> str:
        if value is None:
            return "-"
        return format(value, spec) if spec and isinstance(value, int | float) else str(value)

    # deferred (start-up): runcost, slurm.cost
    from hpc_ddp.watch.runcost import cost_cells, sweep_cost

    gpus = any((r.get("cost") or {}).get("gpu_hours") for r in rows)
    header = ("run", "job", "state", "restarts", "step", "loss", "eval acc", "samples/s", "sync",
              "queued", "running", "CPU-h", *(("GPU-h",) if gpus else ()))
    lines = [header] + [(r["label"], fmt(r["job_id"]), _state_cell(r), restarts_cell(r),
                         f"{fmt(r['step'])}/{fmt(r['total_steps'])}", fmt(r["loss"], ".4f"),
                         fmt(r["eval_accuracy"], ".4f"), fmt(r.get("samples_per_s"), ".0f"),
                         percent(r.get("sync_share")),
                         *cost_cells(r.get("cost"), gpus)) for r in rows]
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    text = "\n".join("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(line))
                     for line in lines)
    top = best(rows)
    if is_sweep and top is not None:
        figure = (f"eval accuracy {top['eval_accuracy']:.4f}"
                  if isinstance(top["eval_accuracy"], int | float)
                  else f"eval loss {top['eval_loss']:.4f}")
        text += f"\nbest point: {top['label']} ({figure}, {top['run_dir']})"
    if is_sweep:
        text += sweep_cost(rows)
    return "\n".join([text, *notes(rows, is_sweep), *status_lines(rows, is_sweep),
                      *([] if is_sweep else failure_lines(rows))])


def _state_cell(r: dict[str, Any]) -> str:
    reason = r.get("reason") if r["state"] == "PENDING" else ""
    return f"{r['state']} ({str(reason).split(',')[0]})" if reason else str(r["state"])


def notes(rows: list[dict[str, Any]], is_sweep: bool) -> list[str]:
    """A line per pending reason, in words (the ones that mean "never" first, with the
    fix); a sweep's points sharing one are named together."""
    said: dict[str, list[str]] = {}
    for r in sorted(rows, key=lambda r: not r.get("never")):
        if r.get("pending"):
            said.setdefault(r["pending"], []).append(str(r["label"] if is_sweep else
                                                         f"job {r['job_id']}"))
    lines = [f"{r['label'] if is_sweep else 'run'}: rank {r['slowest_rank']:.0f} is "
             f"{100 * r['slowest_behind']:.0f}% behind the other ranks (data wait + forward)"
             for r in rows if isinstance(r.get("slowest_behind"), int | float)
             and r["state"] == "RUNNING"]
    for line, who in said.items():
        named = ", ".join(who) if len(who) <= 6 else \
            f"{', '.join(who[:3])}, ... {who[-1]} ({len(who)} points)"
        lines.append(f"{named}: {line}" if is_sweep else f"{who[0]} {line}")
    if any(r.get("never") for r in rows):
        lines.append("(a job that can never start stays queued until cancelled: --cancel)")
    return lines


def finished(rows: list[dict[str, Any]]) -> bool:
    """Every job has ended, or can never start (watching it would never end)."""
    return all(ended(str(r["state"]), bool(r.get("never"))) for r in rows)


def plot(runs: list[tuple[str, Path]], out_png: Path) -> None:
    """The runs' curves and, for a sweep, the final metric by hyperparameter (sweep/plot.py)."""
    # deferred (start-up): sweep.plot
    from hpc_ddp.sweep.plot import plot_runs

    plot_runs(runs, out_png)


def check_args(args: argparse.Namespace) -> None:
    """The options' values, before anything is read or drawn (UserError if bad)."""
    if not (math.isfinite(args.interval) and args.interval > 0):
        raise UserError("--interval", args.interval, "must be a positive number of seconds.",
                        "e.g. --interval 5.")
    if args.plot is None:
        return
    # deferred: matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    folder = args.plot.parent
    if not folder.is_dir():
        raise UserError("--plot", str(args.plot), f"its folder {folder} does not exist.",
                        "create the folder first, or write the file elsewhere.")
    kinds = FigureCanvasBase.get_supported_filetypes()
    if args.plot.suffix.lower().lstrip(".") not in kinds:
        raise UserError("--plot", str(args.plot), "does not end in an image type matplotlib "
                        "writes.", "end it with .png (or .pdf, .svg).")


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    from hpc_ddp.remote.handle import forwarded  # deferred (start-up): remote.handle

    if (code := forwarded("status", sys.argv[1:] if argv is None else argv, out)) is not None:
        return code  # a remote run's local handle: run where the run is (docs/remote.md)
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.status", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a run dir, a sweep dir, or a job id")
    parser.add_argument("--watch", action="store_true", help="refresh until every job ends")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes")
    parser.add_argument("--plot", type=Path, help="write a PNG comparing the runs' curves")
    parser.add_argument("--cancel", action="store_true", help="cancel the run or every point")
    parser.add_argument("--stop", action="store_true",
                        help="stop at a step the ranks agree on, with a checkpoint")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    try:
        check_args(args)
        if study_status.is_study(args.path.absolute()):  # an adaptive sweep's folder
            if args.cancel:
                return study_status.cancel(args.path.absolute(), out, os.environ)
            return study_status.show(args.path.absolute(), out, os.environ, args.json,
                                     args.plot)
        runs, manifest = runs_of(args.path.absolute(), str(args.path))
        return _show(args, runs, manifest, out)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except KeyboardInterrupt:  # Ctrl-C ends --watch; the jobs go on
        return 130
    except BrokenPipeError:  # `... | head`: the reader has all it wanted

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _show(args: argparse.Namespace, runs: list[tuple[str, Path]],
          manifest: dict[str, Any] | None, out: TextIO) -> int:
    if args.cancel or args.stop:
        from hpc_ddp.watch.stoprun import acted_on  # deferred (start-up): stoprun

        acted_on(args.path.absolute(), runs)
    if args.cancel:
        return _cancel(runs, manifest, out)
    if args.stop:
        from hpc_ddp.watch.stoprun import stop  # deferred (start-up): stoprun

        return stop(runs, out)
    looks = Lookups()
    while True:
        rows = rows_of(runs, looks)
        if args.json:
            print(json.dumps({"runs": rows, "best": best(rows)}, indent=2), file=out)
        elif args.watch and out.isatty():
            print("\033[H\033[J" + render(rows, manifest is not None), file=out, flush=True)
        else:
            print(render(rows, manifest is not None), file=out, flush=True)
        if not args.watch or finished(rows):
            break
        time.sleep(args.interval)
    if args.plot:
        plot(runs, args.plot)
        print(f"plot written to {args.plot}", file=out)
    return 0


def _cancel(runs: list[tuple[str, Path]], manifest: dict[str, Any] | None, out: TextIO) -> int:
    if manifest is not None and manifest.get("kind") == "slurm" and manifest.get("arrays"):
        from hpc_ddp.slurm.state import TERMINAL  # deferred (start-up): slurm.state

        rows = rows_of(runs)
        # Only the arrays with a point that has not ended: cancelling an ended run cancels
        # nothing, and saying so is the truth (docs/api.md).
        live = {str(r["job_id"]).split("_")[0] for r in rows
                if r["job_id"] and r["state"] not in TERMINAL}
        arrays = [a for a in manifest["arrays"] if a in live]
        if not arrays:
            states = Counter(str(r["state"]) for r in rows)
            print("every point had ended already (" + ", ".join(
                f"{n} {state}" for state, n in states.most_common()) + "); nothing to cancel",
                  file=out)
            return 0
        unstarted = sum(never_started(Path(r["run_dir"]), r["state"]) for r in rows)
        subprocess.run(["scancel", *arrays], check=False)
        ended = len(manifest["arrays"]) - len(arrays)
        print(f"cancelled job array(s) {', '.join(arrays)}"
              + (f"; {ended} other array(s) had ended already" if ended else ""), file=out)
        if unstarted:
            print(f"{unstarted} of {len(rows)} points had never started: nothing ran there, "
                  "nothing is lost", file=out)
        return 0
    from hpc_ddp.slurm.queued import KNOWN  # deferred (start-up): slurm.queued

    for label, run_dir in runs:
        job = read_json(run_dir / JOB_FILE) or KNOWN.get(run_dir)
        if not job:
            continue
        run = Run(run_dir, job)
        before = run.job_state()
        if not run.cancel():
            print(f"{label} (job {job['job_id']}) had ended already; nothing to cancel",
                  file=out)
        elif never_started(run_dir, before.state):  # an sbatch job's run dir: not made yet
            again = resume_command(run_dir) if run_dir.exists() else "sbatch it again"
            print(f"cancelled {label} (job {job['job_id']}) before it ever started: nothing "
                  f"trained, nothing to resume. To run it after all (from step 0"
                  f"{_fix_of(run_dir, before)}): {again}", file=out)
        else:
            print(f"cancelled {label} (job {job['job_id']}); continue it with: "
                  f"{resume_command(run_dir)}", file=out)
    return 0


def never_started(run_dir: Path, state: str) -> bool:
    """A pending job that never ran: no rank record, progress or checkpoint (a requeued job
    is PENDING again, with them)."""

    files = RunDir(run_dir)
    return state == "PENDING" and not any(
        p.exists() for p in (files.ranks, files.progress, files.checkpoints, files.summary))


def _fix_of(run_dir: Path, state: Any) -> str:
    # deferred (start-up): slurm.fit, slurm.reasons
    from hpc_ddp.slurm.fit import lazy_partitions
    from hpc_ddp.slurm.reasons import pending_of

    pending = pending_of(state, run_dir, lazy_partitions())
    if pending is None or not pending.never:
        return ""
    return f"; it could never start as it was, so first: {pending.fix}"


if __name__ == "__main__":
    sys.exit(main())
