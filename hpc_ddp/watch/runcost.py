"""What a run cost (docs/observability.md#what-a-run-cost): wall time, time queued and
running, CPU-hours and GPU-hours.

A Slurm run: from accounting, summed over every start of every job the run was submitted as
(requeues, resumes), in the one sacct call a status refresh makes (slurm/state.py's
query_with_cost) or, at the end of a followed run, one sacct call for its jobs. A local run:
the wall time from its submission, and the CPU time its rank processes used (each rank
records its own at exit: ranks/rank<N>.usage.json). Once the run has ended, its cost is
written into summary.json as ``cost``.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

from hpc_ddp.rundir import USAGE_SUFFIX, RunDir, read_json, write_json
from hpc_ddp.slurm.cost import Cost, amount, hours, total


def job_ids(job: dict[str, Any] | None) -> list[str]:
    """Every job id a run was submitted as (job.json's history: a resume is a new job)."""
    if not job:
        return []
    history = job.get("history") or [job]
    return [str(h["job_id"]) for h in history if h.get("job_id")]


def slurm_cost(job: dict[str, Any] | None, costs: dict[str, Cost],
               gpus_per_node: int = 0) -> Cost | None:
    """A Slurm run's cost from its jobs' costs (None while accounting knows none of them).
    Where accounting counts no GPUs (a site whose AccountingStorageTRES leaves gres/gpu
    out), its GPU-hours are its node-hours times the ``gpus_per_node`` it asked for."""
    found = [costs[i] for i in job_ids(job) if i in costs]
    if not found:
        return None
    summed = total(found)
    gpu = summed.gpu_hours or summed.node_hours * gpus_per_node
    return Cost(span(found), summed.queue_s, summed.running_s, summed.cpu_hours, gpu,
                summed.starts, summed.node_hours)


def span(found: list[Cost]) -> float:
    """The wall time of a run's jobs, one after the other (a resume is a new job): from the
    first one's submission to the last one's end (or now), the time between them included,
    as sacct's Submit and End of those jobs give it (issue 46: the jobs' own wall times
    added up said 28 s of a run sacct spans over 34 s). Their sum where accounting gave a
    job no submission time."""
    if any(c.submitted is None for c in found):
        return sum(c.wall_s for c in found)
    ends = [(c.submitted or 0.0) + c.wall_s for c in found]
    return max(ends) - min(c.submitted or 0.0 for c in found)


def _with_gpus(run: RunDir, cost: Cost | None, job: dict[str, Any],
               costs: dict[str, Cost]) -> Cost | None:
    """``cost``, with GPU-hours from the config's GPUs per node where accounting has none
    (config.yaml is read only then)."""
    if cost is None or cost.gpu_hours or not cost.node_hours:
        return cost
    return slurm_cost(job, costs, gpus_per_node(run))


def gpus_per_node(run: RunDir) -> int:
    """The GPUs per node the run's config asks for (config.yaml; 0 when it cannot say), read
    once per run dir by a command (a status --watch of a large sweep refreshes often)."""
    return _gpus_per_node(str(run.config))


@functools.lru_cache(maxsize=8192)
def _gpus_per_node(config: str) -> int:
    import yaml  # deferred (start-up): yaml

    try:
        cfg = yaml.safe_load(Path(config).read_text())
        found = cfg["cluster"]["gpus_per_node"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return 0
    return found if isinstance(found, int) and not isinstance(found, bool) else 0


def local_cost(run: RunDir, job: dict[str, Any] | None, ended: float | None) -> Cost | None:
    """A local run's cost: wall time from the first submission to ``ended`` (or now); running
    time summed over its attempts (each from its submission to its last rank's exit: the
    idle time between a run and its resume is not running); every attempt's CPU time."""
    if not job or not job.get("submitted"):
        return None
    history = job.get("history") or [job]
    first = float(history[0].get("submitted") or job["submitted"])
    wall = max(0.0, (ended or time.time()) - first)
    usage = _usage(run)
    cpu_s = sum(float(u.get("cpu_s") or 0.0) for u in usage)
    exits = sorted(float(u.get("time") or 0.0) for u in usage)
    starts = [float(e.get("submitted") or first) for e in history]
    running = end = 0.0
    for i, began in enumerate(starts):  # an attempt ends at its ranks' last exit before the next
        until = starts[i + 1] if i + 1 < len(starts) else float("inf")
        mine = [t for t in exits if began <= t < until]
        last = i == len(starts) - 1
        end = mine[-1] if mine else ((ended or time.time()) if last else began)
        running += max(0.0, end - began)
    if ended is not None:
        # The last attempt's end: its last rank's exit, not when a file was touched; never
        # an earlier attempt's (a resume whose ranks were killed before recording theirs).
        wall = max(0.0, end - first)
    return Cost(wall, 0.0, running, cpu_s / 3600, 0.0, len(history), submitted=first)


def _usage(run: RunDir) -> list[dict[str, Any]]:
    """Every rank's CPU time per attempt (rank/join/joined.py writes them at exit)."""
    try:
        names = [e.name for e in os.scandir(run.ranks) if e.name.endswith(USAGE_SUFFIX)]
    except OSError:
        return []
    found = []
    for name in names:
        usage = read_json(run.ranks / name)
        if isinstance(usage, dict):  # {"attempts": {...}}; before: one attempt's fields
            found += list(usage.get("attempts", {}).values()) if "attempts" in usage else [usage]
    return found


def record(run: RunDir, cost: Cost) -> None:
    """``cost`` into summary.json (an ended run's; nothing before the summary exists)."""
    summary = read_json(run.summary)
    if isinstance(summary, dict) and summary.get("cost") != cost.as_dict():
        write_json(run.summary, {**summary, "cost": cost.as_dict()})


def finish(run: RunDir) -> Cost | None:
    """At the end of a followed run: its cost (one sacct call for a Slurm run), recorded in
    summary.json."""
    job = read_json(run.root / "job.json")
    if not isinstance(job, dict):
        return None
    if job.get("kind") == "slurm":
        from hpc_ddp.slurm.state import costs  # deferred (start-up): slurm.state

        found = costs(job_ids(job))
        cost = _with_gpus(run, slurm_cost(job, found), job, found)
    else:
        ended = _mtime(run.summary)
        cost = local_cost(run, job, ended)
    if cost is not None:
        record(run, cost)
    return cost


def run_cost(run_dir: Path, job: dict[str, Any] | None, state: str,
          costs: dict[str, Any]) -> dict[str, Any] | None:
    """A status row's cost so far (``costs``: the refresh's, by job id); an ended run's is
    kept in its summary.json."""
    from hpc_ddp.slurm.state import TERMINAL  # deferred (start-up): slurm.state

    run = RunDir(run_dir)
    ended = state in TERMINAL
    if job and job.get("kind") == "slurm":
        cost = _with_gpus(run, slurm_cost(job, costs), job, costs)
    else:
        cost = local_cost(run, job, _mtime(run.summary) if ended else None)
    if cost is None:
        return None
    if ended:
        record(run, cost)
    return cost.as_dict()


def cost_cells(cost: dict[str, Any] | None, gpus: bool) -> tuple[str, ...]:
    """A row's queued, running, CPU-hours (and GPU-hours) cells."""
    if not cost:
        return ("-",) * (4 if gpus else 3)
    cells = (hours(cost["queue_s"]), hours(cost["running_s"]), amount(cost["cpu_hours"]))
    return (*cells, amount(cost["gpu_hours"])) if gpus else cells


def sweep_cost(rows: list[dict[str, Any]]) -> str:
    """"\ncost: 4 points, 1.20 GPU-hours (0.30 a point), ..." (nothing before any cost)."""
    found = [Cost(**r["cost"]) for r in rows if r.get("cost")]
    if not found:
        return ""
    whole = total(found)
    points = len(found)
    gpu = (f"{amount(whole.gpu_hours)} GPU-hours ({amount(whole.gpu_hours / points)} a "
           "point), " if whole.gpu_hours else "")
    return (f"\ncost: {points} points, {gpu}{amount(whole.cpu_hours)} CPU-hours "
            f"({amount(whole.cpu_hours / points)} a point), queued {hours(whole.queue_s)} "
            f"and running {hours(whole.running_s)} in all")


def line(cost: Cost) -> str:
    """"wall 12m05s (queued 2m01s, running 10m04s), 1.20 CPU-hours, 0.40 GPU-hours"."""
    gpu = f", {amount(cost.gpu_hours)} GPU-hours" if cost.gpu_hours else ""
    queued = f"queued {hours(cost.queue_s)}, " if cost.queue_s else ""
    return (f"wall {hours(cost.wall_s)} ({queued}running {hours(cost.running_s)}), "
            f"{amount(cost.cpu_hours)} CPU-hours{gpu}")


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
