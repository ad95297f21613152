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

from hpc_ddp.owned import open_append
from hpc_ddp.rundir import write_text

FILE = "events.jsonl"

# The kinds of event (each line's "kind"), by who writes them. The supervisors
# (rank/supervise/outcome.py): a rank's failure, an agreed stop, a requeue the ranks asked
# for, a restart of every rank in place.
FAILURE = "failure"
STOP = "stop"
REQUEUE = "requeue"
RESTART_IN_PLACE = "restart_in_place"
# The first step after a restart that followed a failure (rank/context/context.py): what
# the failure cost.
RECOVERED = "recovered"
# A resume that skipped unusable checkpoints (rank/services/checkpoint.py).
CHECKPOINT_FALLBACK = "checkpoint_fallback"
# The node-loss driver (slurm/driver.py): nodes lost, left out of a requeued job, a step
# started again on fewer nodes (it also writes RESTART_IN_PLACE and REQUEUE).
NODE_LOST = "node_lost"
NODES_EXCLUDED = "nodes_excluded"
SHRINK = "shrink"
KINDS = frozenset({FAILURE, STOP, REQUEUE, RESTART_IN_PLACE, RECOVERED, CHECKPOINT_FALLBACK,
                   NODE_LOST, NODES_EXCLUDED, SHRINK})


def append(run_root: Path, event: dict[str, Any]) -> None:
    """One line, written with O_APPEND in a single write: lines from ranks never interleave.
    owned.Untrusted where events.jsonl is a symbolic link or not this user's file: the line
    would be written wherever it points (owned.open_append)."""
    line = json.dumps({"time": time.time(), **event}, sort_keys=True) + "\n"
    fd = open_append(run_root / FILE)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def cause_fields(run_root: Path, message: str, attempt: int, rank: int,
                 generation: int = 0) -> dict[str, str]:
    """An event's ``cause`` in one line (the message's first line, and its last where it has
    more: a script's last words), and with more lines, ``lines``: the run-dir path of a file
    that holds them all (logs/failure-attempt<A>-rank<R>.txt), so the history stays one short
    line per event however many lines a failure printed (docs/observability.md). A restart
    in place's (``generation`` > 0) has a file of its own."""
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    if len(lines) <= 1:
        return {"cause": message.strip()}
    name = f"logs/failure-attempt{attempt}{f'.{generation}' if generation else ''}-rank{rank}.txt"
    try:
        (run_root / "logs").mkdir(exist_ok=True)
        # Replaced, not written in place: a link planted at the name is replaced, its target
        # left alone (rundir.write_text).
        write_text(run_root / name, message.strip() + "\n")
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
    return sum(1 for e in events if e.get("kind") == REQUEUE)


def restarts_spent(events: list[dict[str, Any]], job: str | None) -> int:
    """What counts against ``cluster.max_restarts``: this job's requeues (a resume=true is a
    new job, with a new budget) since the last one that made progress. A requeue after new
    checkpoints were written (a time-limit slice of a long run) is not a failure and starts
    the count again; requeues at the same checkpoint step (a crash loop) add up. Slurm's own
    requeues (preemption, node failure) are not hpc_ddp's and never count."""
    spent, last_step = 0, None
    for e in events:
        if e.get("kind") != REQUEUE or (job is not None and e.get("job") != job):
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
    for kinds in ((REQUEUE,), (STOP, FAILURE)):
        found = [e for e in mine if e.get("kind") in kinds]
        if found:
            return found[0].get("cause")
    return None


def after_failure(events: list[dict[str, Any]]) -> bool:
    """This start follows a failure not yet recovered from (its first step is recorded as
    "recovered": what the failure cost). A start after a stop (a time limit) is not one."""
    for e in reversed(events):
        if e.get("kind") in (FAILURE, STOP, RECOVERED):
            return e.get("kind") == FAILURE
    return False


def recovery(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What failures cost the run (summary.json, status): the restarts in place, requeues
    and nodes left out, and per failure its cause, rank and node, the seconds from the
    failure to the first step after the restart (the "recovered" event its next start
    appends) and the steps lost (how far the training had got, as progress.json said when
    the failure was recorded, less the step it resumed from)."""
    failures = []
    for i, e in enumerate(events):
        if e.get("kind") != FAILURE:
            continue
        at = e.get("failed_at", e.get("time"))
        later = events[i + 1:]
        upto = next((j for j, x in enumerate(later) if x.get("kind") == FAILURE), len(later))
        back = next((x for x in later[:upto] if x.get("kind") == RECOVERED), None)
        how = next((x.get("kind") for x in later[:upto]
                    if x.get("kind") in (RESTART_IN_PLACE, REQUEUE)), None)
        reached, resumed = e.get("reached"), None if back is None else back.get("from_step")
        failures.append({
            "cause": str(e.get("cause", "")).splitlines()[0][:300] if e.get("cause") else "",
            "rank": e.get("rank"), "host": e.get("host"), "attempt": e.get("attempt"),
            "generation": e.get("generation", 0), "time": at, "recovered_by": how,
            "seconds_to_first_step": None if back is None or at is None
            else round(float(back["time"]) - float(at), 3),
            "steps_lost": None if reached is None or resumed is None
            else max(0, int(reached) - int(resumed))})
    excluded = sorted({n for e in events if e.get("kind") in (NODE_LOST, NODES_EXCLUDED)
                       for n in e.get("nodes", [])})
    return {"restarts_in_place": sum(1 for e in events if e.get("kind") == RESTART_IN_PLACE),
            "requeues": requeues_by_us(events), "excluded_nodes": excluded,
            "failures": failures, "shrinks": shrinks(events, failures)}


def shrinks(events: list[dict[str, Any]], failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each time the run went on with fewer nodes (cluster.min_nodes): when, which nodes
    were lost, the nodes and world size before and after, and what the failure that caused
    it cost (the steps lost, the seconds from the failure to the first step after)."""
    found = []
    for e in events:
        if e.get("kind") != SHRINK:
            continue
        cause: dict[str, Any] = next((f for f in reversed(failures)
                      if f.get("time") is not None and f["time"] <= e.get("time", 0)), {})
        found.append({"time": e.get("time"), "lost": e.get("lost", []),
                      "nodes_before": e.get("nodes_before"), "nodes_after": e.get("nodes_after"),
                      "world_before": e.get("world_before"), "world_after": e.get("world_after"),
                      "steps_lost": cause.get("steps_lost"),
                      "seconds_to_first_step": cause.get("seconds_to_first_step")})
    return found
