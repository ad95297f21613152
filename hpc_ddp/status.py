"""The state of a run or a whole sweep: ``python -m hpc_ddp.status <run_dir | sweep_dir>``.

    python -m hpc_ddp.status multirun/2026-11-30_10-00-00            # a table, the best point
    python -m hpc_ddp.status multirun/2026-11-30_10-00-00 --watch    # refresh until all end
    python -m hpc_ddp.status multirun/2026-11-30_10-00-00 --plot curves.png
    python -m hpc_ddp.status outputs/try1 --cancel                   # cancel a run or a sweep
    python -m hpc_ddp.status outputs/try1 --json

Per job: Slurm's state (sacct, squeue when accounting is absent) or the local state,
restarts, current step, latest loss and eval accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.api import JOB_FILE, Run
from hpc_ddp.rundir import read_json


def runs_of(path: Path) -> tuple[list[tuple[str, Path]], dict[str, Any] | None]:
    """(label, run dir) of every run under ``path`` (one for a run, all points of a sweep)."""
    from hpc_ddp.sweep.launch import read_manifest

    manifest = read_manifest(path)
    if manifest is not None:
        return [(p["label"], Path(p["run_dir"])) for p in manifest["points"]], manifest
    if (path / JOB_FILE).is_file() or (path / "config.yaml").is_file():
        return [(path.name, path)], None
    raise FileNotFoundError(f"{path} is neither a run dir nor a sweep dir (no job.json, "
                            "config.yaml or sweep.json)")


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
            "eval_accuracy": summary.get("eval_accuracy")}


def best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    scored = [r for r in rows if isinstance(r["eval_accuracy"], int | float)]
    return max(scored, key=lambda r: r["eval_accuracy"]) if scored else None


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
        text += f"\nbest point: {top['label']} (eval accuracy {top['eval_accuracy']:.4f}, " \
                f"{top['run_dir']})"
    return text


def finished(rows: list[dict[str, Any]]) -> bool:
    from hpc_ddp.launch.slurm_state import TERMINAL

    return all(r["state"] in (*TERMINAL, "FAILED", "NOT SUBMITTED") for r in rows)


def plot(runs: list[tuple[str, Path]], out_png: Path) -> None:
    """Training loss and eval accuracy of every run, one line each, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for label, run_dir in runs:
        job = read_json(run_dir / JOB_FILE) or {"kind": "local", "job_id": "?"}
        scalars = Run(run_dir, job).scalars() if (run_dir / "tb").is_dir() else {}
        for ax, tag in ((loss_ax, "train/loss"), (acc_ax, "eval/accuracy")):
            if scalars.get(tag):
                steps, values = zip(*scalars[tag], strict=True)
                ax.plot(steps, values, marker="o", markersize=3, label=label)
    for ax, title in ((loss_ax, "train/loss"), (acc_ax, "eval/accuracy")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


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
        runs, manifest = runs_of(args.path.absolute())
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
        if job:
            Run(run_dir, job).cancel()
            print(f"cancelled {label} (job {job['job_id']})", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
