"""What failures cost a run, as `status` prints it (events.recovery reads it from
events.jsonl; docs/fault-tolerance.md#what-a-failure-cost). Pure."""

from __future__ import annotations

import time
from typing import Any

from hpc_ddp.ranklines import for_terminal


def restarts_cell(r: dict[str, Any]) -> str:
    """The restarts column: all of them, and how many were in place."""
    in_place = (r.get("recovery") or {}).get("restarts_in_place") or 0
    shown = "-" if r["restarts"] is None else str(r["restarts"])
    return f"{shown} ({in_place} in place)" if in_place else shown


def failure_lines(rows: list[dict[str, Any]], last: int = 5) -> list[str]:
    """A run's failures, what each cost, and the nodes it left out (a single run's view)."""
    lines = []
    for r in rows:
        recovery = r.get("recovery") or {}
        for f in recovery.get("failures", [])[-last:]:
            how = {"restart_in_place": "restarted in place", "requeue": "requeued"}.get(
                f.get("recovered_by") or "", "not restarted")
            cost = ""
            if f.get("seconds_to_first_step") is not None:
                cost = f", training again {f['seconds_to_first_step']:.1f}s later"
            if f.get("steps_lost") is not None:
                cost += f", {f['steps_lost']} steps lost"
            lines.append(for_terminal(f"failure: rank {f.get('rank')} on {f.get('host')}: "
                                      f"{str(f.get('cause'))[:160]} ({how}{cost})"))
        for k in recovery.get("shrinks", []):
            cost = "".join([f", {k['steps_lost']} steps lost" if k.get("steps_lost") is not None
                            else "", f", training again {k['seconds_to_first_step']:.1f}s "
                            "after the failure" if k.get("seconds_to_first_step") is not None
                            else ""])
            lines.append(f"shrank: {k.get('nodes_before')} -> {k.get('nodes_after')} nodes "
                         f"(world size {k.get('world_before')} -> {k.get('world_after')}) "
                         f"at {_clock(k.get('time'))} after {', '.join(k.get('lost') or [])} "
                         f"was lost, in the same job{cost}")
        if recovery.get("excluded_nodes"):
            lines.append(f"nodes left out after failing: {', '.join(recovery['excluded_nodes'])}")
    return lines


def _clock(when: float | None) -> str:
    return "?" if when is None else time.strftime("%H:%M:%S", time.localtime(when))
