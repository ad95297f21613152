"""The run's restart history: one JSON line per stop, failure and requeue (run_dir/events.jsonl).

Appended by whichever rank saw the event; read when the next attempt starts, to say why it
started and to count the restarts hpc_ddp asked for (``cluster.max_restarts``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

FILE = "events.jsonl"


def append(run_root: Path, event: dict[str, Any]) -> None:
    """One line, written with O_APPEND in a single write: lines from ranks never interleave."""
    line = json.dumps({"time": time.time(), **event}, sort_keys=True) + "\n"
    fd = os.open(run_root / FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def cause_fields(run_root: Path, message: str, attempt: int, rank: int) -> dict[str, str]:
    """An event's ``cause`` in one line (the message's first line, and its last where it has
    more: a script's last words), and with more lines, ``lines``: the run-dir path of a file
    that holds them all (logs/failure-attempt<A>-rank<R>.txt), so the history stays one short
    line per event however many lines a failure printed (docs/observability.md)."""
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    if len(lines) <= 1:
        return {"cause": message.strip()}
    name = f"logs/failure-attempt{attempt}-rank{rank}.txt"
    try:
        (run_root / "logs").mkdir(exist_ok=True)
        with open(run_root / name, "w") as handle:
            handle.write(message.strip() + "\n")
    except OSError:  # the history keeps the cause at least
        return {"cause": f"{lines[0]} ... {lines[-1].strip()}"}
    return {"cause": f"{lines[0]} ... {lines[-1].strip()}", "lines": name}


def read(run_root: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_root / FILE).read_text().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash mid-write
    return events


def requeues_by_us(events: list[dict[str, Any]]) -> int:
    """Requeues hpc_ddp asked for (time limits, failures) over the run's whole life."""
    return sum(1 for e in events if e.get("kind") == "requeue")


def restarts_spent(events: list[dict[str, Any]], job: str | None) -> int:
    """What counts against ``cluster.max_restarts``: this job's requeues (a resume=true is a
    new job, with a new budget) since the last one that made progress. A requeue after new
    checkpoints were written (a time-limit slice of a long run) is not a failure and starts
    the count again; requeues at the same checkpoint step (a crash loop) add up. Slurm's own
    requeues (preemption, node failure) are not hpc_ddp's and never count."""
    spent, last_step = 0, None
    for e in events:
        if e.get("kind") != "requeue" or (job is not None and e.get("job") != job):
            continue
        step = e.get("step")
        progressed = step is not None and (last_step is None or step > last_step)
        spent = 0 if progressed else spent + 1
        last_step = step if step is not None else last_step
    return spent


def last_reason(events: list[dict[str, Any]], attempt: int,
                job: str | None = None) -> str | None:
    """Why attempt ``attempt`` (of ``job``, when given: an earlier job's attempts have the
    same numbers) ended: the cause its requeue gave, else its first stop or failure (later
    ones are echoes: ranks killed by the requeue report lost peers too)."""
    mine = [e for e in events if e.get("attempt") == attempt
            and (job is None or e.get("job") in (None, job))]
    for kinds in (("requeue",), ("stop", "failure")):
        found = [e for e in mine if e.get("kind") in kinds]
        if found:
            return found[0].get("cause")
    return None
