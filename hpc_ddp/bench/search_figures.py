"""What one way of running a search cost (bench search's figures, pure): node-seconds held by
the workers, node-seconds of trials, the idle share between them, and the node-seconds held
until a trial first reached a target value (the plugin-like way's final best).

Times are Unix seconds. A worker holds its ``nodes`` from its start to its end (its
``workers/<i>.json``: ``began``, ``ended``); a trial runs from Optuna's ``datetime_start``
to ``datetime_complete``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Two values this close are the same (the same grid point trained the same way).
SAME = 1e-9


@dataclass(frozen=True)
class Trial:
    number: int
    start: float
    end: float
    value: float | None
    state: str  # COMPLETE, PRUNED, FAIL, RUNNING


@dataclass(frozen=True)
class WayFigures:
    way: str
    trials: int
    pruned: int
    wall_s: float
    held_node_s: float
    trial_node_s: float
    idle_share: float
    best: float | None
    to_target_node_s: float | None  # None: the target was never reached

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def held(workers: Sequence[tuple[float, float]], nodes: int, until: float | None = None) -> float:
    """Node-seconds the workers held, up to ``until`` (all of it when None)."""
    total = 0.0
    for began, ended in workers:
        stop = ended if until is None else min(ended, until)
        total += max(0.0, stop - began)
    return total * nodes


def better(value: float, target: float, minimize: bool) -> bool:
    """``value`` is at least as good as ``target``."""
    return value <= target + SAME * max(1.0, abs(target)) if minimize else (
        value >= target - SAME * max(1.0, abs(target)))


def best_of(trials: Sequence[Trial], minimize: bool) -> float | None:
    values = [t.value for t in trials if t.state == "COMPLETE" and t.value is not None]
    if not values:
        return None
    return min(values) if minimize else max(values)


def figures(way: str, trials: Sequence[Trial], workers: Sequence[tuple[float, float]],
            nodes: int, minimize: bool, target: float | None) -> WayFigures:
    """The figures of one way."""
    held_s = held(workers, nodes)
    trial_s = sum(max(0.0, t.end - t.start) for t in trials) * nodes
    first = min((b for b, _ in workers), default=0.0)
    last = max((e for _, e in workers), default=0.0)
    reached = sorted(t.end for t in trials if t.state == "COMPLETE" and t.value is not None
                     and target is not None and better(t.value, target, minimize))
    return WayFigures(
        way=way, trials=len(trials), pruned=sum(t.state == "PRUNED" for t in trials),
        wall_s=max(0.0, last - first), held_node_s=held_s, trial_node_s=trial_s,
        idle_share=max(0.0, 1.0 - trial_s / held_s) if held_s > 0 else 0.0,
        best=best_of(trials, minimize),
        to_target_node_s=held(workers, nodes, reached[0]) if reached else None)


def table(rows: Sequence[WayFigures], target: float | None) -> str:
    """The figures as text, one way a line, each against the first (the plugin's way)."""
    head = (f"{'way':<22s} {'trials':>6s} {'pruned':>6s} {'wall s':>7s} {'held node-s':>11s} "
            f"{'idle':>5s} {'best':>10s} {'node-s to best':>14s} {'x batched':>9s}")
    lines = [head]
    base = rows[0].to_target_node_s if rows else None
    for r in rows:
        ratio = ("-" if base is None or r.to_target_node_s is None or base <= 0
                 else f"{r.to_target_node_s / base:.2f}")
        best = "-" if r.best is None else f"{r.best:.6g}"
        to = "never" if r.to_target_node_s is None else f"{r.to_target_node_s:.1f}"
        lines.append(f"{r.way:<22s} {r.trials:>6d} {r.pruned:>6d} {r.wall_s:>7.1f} "
                     f"{r.held_node_s:>11.1f} {100 * r.idle_share:>4.0f}% {best:>10s} "
                     f"{to:>14s} {ratio:>9s}")
    if target is not None:
        lines.append(f"target: {target:.6g}, the batched search's final best; node-s to best: "
                     "node-seconds the workers held until a trial first reached it")
    return "\n".join(lines)
