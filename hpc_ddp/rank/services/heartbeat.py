"""Each rank's training tells its supervisors that it moves: a heartbeat on the store.

A rank whose step stops moving while no collective times out (a read from a hung file
system, a deadlock in a data loader, NCCL's long default timeout) is found by rank 0's
supervisor, which reads every rank's heartbeat (supervise/hangs.py). The beat is one store
write of a few bytes every BEAT_S at most, on the connection the rank already has (nothing on
the shared file system); the step's cost is a clock read.
"""

from __future__ import annotations

import time
from typing import Any

# The step a rank beats before its first one (its Context exists): a rank that hangs before
# any step is watched too.
STARTING = -1
# At most one beat per this many seconds (fewer with a short trainer.hang_timeout_s).
BEAT_S = 5.0
# The beats rank 0's store takes per second at most, whatever the world size: with more ranks
# each beats less often (8,000 ranks: one beat per rank every 40 s). A rank's own cost stays
# one write per interval; the default hang timeout (5 minutes or more) stays far above it.
STORE_BEATS_PER_S = 200.0


def key(rank: int) -> str:
    """Where rank ``rank``'s training leaves its heartbeat (under its generation's prefix)."""
    return f"hpc_ddp/beat/{rank}"


def interval(hang_timeout_s: float | None, world_size: int = 1) -> float:
    """Seconds between beats: BEAT_S, longer in a world whose beats would pass
    STORE_BEATS_PER_S, and at most a quarter of a hang timeout the user set."""
    every = max(BEAT_S, world_size / STORE_BEATS_PER_S)
    return every if hang_timeout_s is None else max(0.5, min(every, hang_timeout_s / 4))


class Heartbeat:
    """This rank's beats: ``beat(step)`` once per step or more often (cheap: a clock read
    unless a beat is due). No store (a run without a supervisor): nothing."""

    def __init__(self, store: Any | None, rank: int, every_s: float) -> None:
        self._store, self._key, self._every = store, key(rank), every_s
        self._next = 0.0

    def beat(self, step: int) -> None:
        now = time.monotonic()
        if self._store is None or now < self._next:
            return
        self._next = now + self._every
        try:
            self._store.set(self._key, f"{step} {time.time():.3f}")
        except Exception:  # the store is gone: the collective that follows says why
            self._store = None
