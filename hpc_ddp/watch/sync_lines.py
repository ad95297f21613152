"""The gradient sync's share of a step in words (trainer/sync_probe.py measures it): the
``sync`` column of ``status``, the row of the results table at a run's end, and a line that
points at the scaling report when the share is large (docs/performance.md#scaling)."""

from __future__ import annotations

from typing import Any

# Above this share of each step spent waiting on gradient sync, a run points at the report:
# hiding all of it would make each step at least 1.33x faster (1 / (1 - 0.25)), a fix worth
# measuring; below it, a fix buys little (docs/performance.md#scaling).
LARGE = 0.25
REPORT = "python -m hpc_ddp.bench scaling"
DOC = "docs/performance.md#scaling"


def _share(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def percent(share: Any) -> str:
    """``41%``; ``-`` where not measured (one rank, FSDP, no sampled step yet)."""
    value = _share(share)
    return "-" if value is None else f"{100 * value:.0f}%"


def summary_cell(summary: dict[str, Any]) -> str | None:
    """The results table's ``gradient sync`` row: ``9% of each step (2.7 of 30.0 ms, 4
    steps sampled)``, above LARGE followed by ``: see <the report> (<its doc>)`` (in the row,
    not under the table: the table's end stays where it was); None where the run measured
    none."""
    share = _share(summary.get("sync_share"))
    if share is None:
        return None
    sync, step = summary.get("sync_ms"), summary.get("sync_step_ms")
    times = (f"{sync:.1f} of {step:.1f} ms, " if isinstance(sync, int | float)
             and isinstance(step, int | float) else "")
    steps = summary.get("sync_sampled_steps")
    sampled = f"{steps} step{'s' if steps != 1 else ''} sampled" if steps else "sampled"
    see = f": see {REPORT} ({DOC})" if share > LARGE else ""
    return f"{percent(share)} of each step ({times}{sampled}){see}"


def pointer(share: Any) -> str | None:
    """``gradient sync 41% of each step: see <the report> (<its doc>)`` when the share is
    above LARGE; None otherwise."""
    value = _share(share)
    if value is None or value <= LARGE:
        return None
    return f"gradient sync {percent(value)} of each step: see {REPORT} ({DOC})"


def status_lines(rows: list[dict[str, Any]], is_sweep: bool) -> list[str]:
    """The pointer under the ``status`` table: the run's, or for a sweep one line naming the
    points above LARGE (the range of their shares)."""
    large = [r for r in rows if pointer(r.get("sync_share")) is not None]
    if not large:
        return []
    if not is_sweep:
        return [f"run: {pointer(large[0]['sync_share'])}"]
    shares = sorted(float(r["sync_share"]) for r in large)
    labels = [str(r["label"]) for r in large]
    named = ", ".join(labels) if len(labels) <= 6 else \
        f"{', '.join(labels[:3])}, ... {labels[-1]} ({len(labels)} points)"
    span = percent(shares[0]) if len(shares) == 1 else \
        f"{percent(shares[0])}-{percent(shares[-1])}"
    return [f"{named}: gradient sync {span} of each step: see {REPORT} ({DOC})"]
