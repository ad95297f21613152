"""The state of a run or a whole sweep: ``python -m hpc_ddp.status <run_dir | sweep_dir>``.

    python -m hpc_ddp.status multirun/2026-11-30_10-00-00            # a table, the best point
    python -m hpc_ddp.status multirun/2026-11-30_10-00-00 --watch    # refresh until all end
    python -m hpc_ddp.status multirun/2026-11-30_10-00-00 --plot curves.png
    python -m hpc_ddp.status outputs/try1 --cancel                   # cancel a run or a sweep
    python -m hpc_ddp.status outputs/try1 --json
    python -m hpc_ddp.status outputs/try1 --watch --interval 30     # refresh every 30 s

Per job: Slurm's state (sacct, squeue when accounting is absent) or the local state,
restarts, current step, latest loss and eval accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.api import JOB_FILE, Run
from hpc_ddp.errors import USAGE_EXIT_CODE, UserError
from hpc_ddp.rundir import read_json, resume_command

# Folders the other commands make, which status cannot follow: (their results file, which
# also marks one once written, the name their config.yaml gives the job, what it is).
OTHER_KINDS = (("doctor.json", "hpc_ddp_doctor", "a doctor run (python -m hpc_ddp.doctor)"),
               ("bench/comm.json", "hpc_ddp_bench-comm",
                "a benchmark run (python -m hpc_ddp.bench comm)"),
               ("bench/train.json", "hpc_ddp_bench-train",
                "a benchmark run (python -m hpc_ddp.bench train)"))


def runs_of(path: Path) -> tuple[list[tuple[str, Path]], dict[str, Any] | None]:
    """(label, run dir) of every run under ``path`` (one for a run, all points of a sweep).

    Raises UserError for anything else, saying what it is when it can be told."""
    from hpc_ddp.sweep.launch import read_manifest

    shown = str(path)
    if not path.exists():
        raise UserError("path", shown, "does not exist.",
                        "pass a run dir (submit prints it) or a sweep dir (sweep.dir).")
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
        from omegaconf import OmegaConf

        try:
            job_name = str(OmegaConf.select(OmegaConf.load(path / "config.yaml"),
                                            "cluster.job_name", default=""))
        except Exception:  # an unreadable config.yaml: not this function's to report
            job_name = ""
    for results, name, what in OTHER_KINDS:
        if (path / results).is_file() or job_name == name:
            return what, results
    return None


def row(label: str, run_dir: Path) -> dict[str, Any]:
    summary = read_json(run_dir / "summary.json") or {}
    progress = read_json(run_dir / "progress.json") or {}
    job = read_json(run_dir / JOB_FILE)
    state = Run(run_dir, job).state if job else "NOT SUBMITTED"
    from hpc_ddp import events

    restarts = summary.get("restarts")
    if restarts is None:
        restarts = sum(1 for e in events.read(run_dir) if e.get("kind") == "requeue")
    return {"label": label, "run_dir": str(run_dir), "job_id": job and job.get("job_id"),
            "state": state, "restarts": restarts,
            "step": summary.get("global_step", progress.get("step")),
            "total_steps": summary.get("total_steps", progress.get("total_steps")),
            "loss": summary.get("final_train_loss", progress.get("loss")),
            "eval_accuracy": summary.get("eval_accuracy"),
            "eval_loss": summary.get("eval_loss")}


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

    header = ("run", "job", "state", "restarts", "step", "loss", "eval acc")
    lines = [header] + [(r["label"], fmt(r["job_id"]), r["state"], fmt(r["restarts"]),
                         f"{fmt(r['step'])}/{fmt(r['total_steps'])}", fmt(r["loss"], ".4f"),
                         fmt(r["eval_accuracy"], ".4f")) for r in rows]
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    text = "\n".join("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(line))
                     for line in lines)
    top = best(rows)
    if is_sweep and top is not None:
        figure = (f"eval accuracy {top['eval_accuracy']:.4f}"
                  if isinstance(top["eval_accuracy"], int | float)
                  else f"eval loss {top['eval_loss']:.4f}")
        text += f"\nbest point: {top['label']} ({figure}, {top['run_dir']})"
    return text


def finished(rows: list[dict[str, Any]]) -> bool:
    from hpc_ddp.launch.slurm_state import TERMINAL

    return all(r["state"] in (*TERMINAL, "FAILED", "NOT SUBMITTED") for r in rows)


def plot(runs: list[tuple[str, Path]], out_png: Path) -> None:
    """The runs' curves and, for a sweep, the final metric by hyperparameter (sweep/plot.py)."""
    from hpc_ddp.sweep.plot import plot_runs

    plot_runs(runs, out_png)


def check_args(args: argparse.Namespace) -> None:
    """The options' values, before anything is read or drawn (UserError if bad)."""
    if not (math.isfinite(args.interval) and args.interval > 0):
        raise UserError("--interval", args.interval, "must be a positive number of seconds.",
                        "e.g. --interval 5.")
    if args.plot is None:
        return
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
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.status", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a run dir or a sweep dir")
    parser.add_argument("--watch", action="store_true", help="refresh until every job ends")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes")
    parser.add_argument("--plot", type=Path, help="write a PNG comparing the runs' curves")
    parser.add_argument("--cancel", action="store_true", help="cancel the run or every point")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    try:
        check_args(args)
        runs, manifest = runs_of(args.path.absolute())
        return _show(args, runs, manifest, out)
    except UserError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except KeyboardInterrupt:  # Ctrl-C ends --watch; the jobs go on
        return 130


def _show(args: argparse.Namespace, runs: list[tuple[str, Path]],
          manifest: dict[str, Any] | None, out: TextIO) -> int:
    if args.cancel:
        return _cancel(runs, manifest, out)
    while True:
        rows = [row(label, run_dir) for label, run_dir in runs]
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
        import subprocess

        subprocess.run(["scancel", *manifest["arrays"]], check=False)
        print(f"cancelled job array(s) {', '.join(manifest['arrays'])}", file=out)
        return 0
    for label, run_dir in runs:
        job = read_json(run_dir / JOB_FILE)
        if not job:
            continue
        if Run(run_dir, job).cancel():
            print(f"cancelled {label} (job {job['job_id']}); continue it with: "
                  f"{resume_command(run_dir)}", file=out)
        else:
            print(f"{label} (job {job['job_id']}) had ended already; nothing to cancel",
                  file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
