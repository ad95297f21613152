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
    """Requeues hpc_ddp asked for (time limits, failures); Slurm's own preemption requeues
    do not count against max_restarts."""
    return sum(1 for e in events if e.get("kind") == "requeue")


def last_reason(events: list[dict[str, Any]], attempt: int) -> str | None:
    """Why attempt ``attempt`` ended: the cause its requeue gave, else its first stop or
    failure (later ones are echoes: ranks killed by the requeue report lost peers too)."""
    mine = [e for e in events if e.get("attempt") == attempt]
    for kinds in (("requeue",), ("stop", "failure")):
        found = [e for e in mine if e.get("kind") in kinds]
        if found:
            return found[0].get("cause")
    return None
