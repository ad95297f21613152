"""What a Slurm job cost, from accounting: wall time, time waiting in the queue and running,
CPU-hours and GPU-hours, summed over every start of the job (a requeued job has one record
per start: ``sacct -D``).

Read from the one ``sacct`` call a status refresh makes (slurm/state.py asks for these fields
with the state), never per rank. https://slurm.schedmd.com/sacct.html#OPT_format
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

# The fields after JobID,State,ExitCode,Reason (state.SACCT_FIELDS): when each start was
# submitted (a requeue resubmits), started and ended; its seconds running; what it held.
FIELDS = ("Submit", "Start", "End", "ElapsedRaw", "AllocCPUS", "AllocTRES", "NNodes")


@dataclass(frozen=True)
class Record:
    """One start of a job, as accounting has it (times as Unix seconds; None: not yet)."""

    submit: float | None
    start: float | None
    end: float | None
    elapsed_s: float
    cpus: int
    gpus: int
    nodes: int = 0

    @classmethod
    def parse(cls, fields: list[str]) -> Record:
        """``fields``: the values of FIELDS, in order ("Unknown", "None", "" where unset)."""
        submit, start, end, elapsed, cpus, tres, nodes = (fields + [""] * 7)[:7]
        return cls(when(submit), when(start), when(end), float(_int(elapsed)), _int(cpus),
                   gpus_of(tres), _int(nodes))


@dataclass(frozen=True)
class Cost:
    """A job's (or a sweep's) cost; hours are allocation hours (what the site bills)."""

    wall_s: float  # first submission to the end (or now)
    queue_s: float  # waiting to start, summed over the starts
    running_s: float  # running, summed over the starts
    cpu_hours: float
    gpu_hours: float
    starts: int
    # Allocated nodes x running time: GPU-hours where accounting does not track GPUs
    # (AccountingStorageTRES without gres/gpu), with the GPUs per node the run asked for.
    node_hours: float = 0.0
    # When the first start was submitted (Unix seconds; sacct's Submit): a resumed run's wall
    # time spans its jobs from this to the last one's end. Not recorded (as_dict).
    submitted: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()
                if k != "submitted"}


def when(text: str) -> float | None:
    """sacct's local time ("2026-12-03T08:10:02") as Unix seconds; None for Unknown/None."""
    try:
        return _dt.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None


def gpus_of(tres: str) -> int:
    """GPUs of an AllocTRES text ("cpu=4,gres/gpu=2,mem=8G,node=1"; a typed one such as
    gres/gpu:h100=2 is listed beside the plain one, and counted alone only without it)."""
    plain, typed = 0, 0
    for part in tres.split(","):
        name, _, value = part.partition("=")
        if name == "gres/gpu":
            plain += _int(value)
        elif name.startswith("gres/gpu:"):
            typed += _int(value)
    return plain or typed


def cost_of(records: Iterable[Record], now: float | None = None) -> Cost:
    """The cost of one job's starts (a running start counts up to ``now``)."""
    now = time.time() if now is None else now
    found = list(records)
    queue = running = cpu = gpu = node = 0.0
    for r in found:
        if r.submit is not None:
            queue += max(0.0, (r.start or r.end or now) - r.submit)
        running += r.elapsed_s
        cpu += r.elapsed_s * r.cpus / 3600
        gpu += r.elapsed_s * r.gpus / 3600
        node += r.elapsed_s * r.nodes / 3600
    submits = [r.submit for r in found if r.submit is not None]
    ends = [r.end for r in found if r.end is not None]
    ongoing = any(r.end is None for r in found)
    last = now if ongoing or not ends else max(ends)
    wall = max(0.0, last - min(submits)) if submits else 0.0
    return Cost(wall, queue, running, cpu, gpu, len(found), node,
                min(submits) if submits else None)


def total(costs: Iterable[Cost]) -> Cost:
    """A sweep's cost: the points' sums (wall time: the longest point's)."""
    found = list(costs)
    return Cost(max((c.wall_s for c in found), default=0.0), sum(c.queue_s for c in found),
                sum(c.running_s for c in found), sum(c.cpu_hours for c in found),
                sum(c.gpu_hours for c in found), sum(c.starts for c in found),
                sum(c.node_hours for c in found))


def hours(seconds: float) -> str:
    """"1h02m", "3m05s", "12s": a duration for a table."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def amount(hours_: float) -> str:
    """CPU- or GPU-hours for a table: two decimals, or two significant digits below 0.1."""
    return f"{hours_:.2f}" if hours_ >= 0.1 or hours_ == 0 else f"{hours_:.2g}"


def _int(text: str) -> int:
    text = text.strip()
    return int(text) if text.isdigit() else 0
