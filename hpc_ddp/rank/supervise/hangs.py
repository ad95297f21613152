"""Hangs that no collective times out: rank 0's supervisor watches every rank's heartbeat.

Each rank's training beats on the store while it steps (services/heartbeat.py). A thread in
rank 0's supervisor reads all beats in one multi_get every few seconds. Once every rank has
beaten (it does when its Context exists, before its first step), a pause in which no rank's
beat moved for ``trainer.hang_timeout_s`` is a hang; unset, the limit is the larger of 5
minutes and 10x the longest pause seen so far (a slow evaluation or checkpoint seen before
never counts), twice that while some rank has not finished its first step. Then every
rank's stacks are dumped (the supervisors' stack relays), the ranks whose main thread is
outside a collective are named with their line (the others wait there for them), and the
generation fails as restartable: every rank restarts in place (generations.py). A rank of
a synchronous job that hangs stops every other rank at its next collective, so "no rank
moved" is the signal. The cost per rank is one small store write per beat; rank 0's, one
read of all the beats per poll.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp.rank.join import rendezvous
from hpc_ddp.rank.join.joined import Rank
from hpc_ddp.rank.join.store_client import PrefixedStore
from hpc_ddp.rank.services import heartbeat, stacks

log = logging.getLogger(__name__)

# The derived timeout: at least this, and this many times the longest pause seen.
MIN_DERIVED_S, PAUSE_FACTOR = 300.0, 10.0
# How long every rank gets to dump its stacks (the report returns once all have): the rank
# that hangs must be among them, or the report names the ones that wait for it.
STACKS_WAIT_S = 15.0
# Before every rank's first step (torch.compile, a first batch's warm-up) the limit is this
# many times longer.
FIRST_STEP_FACTOR = 2.0


def limit(configured: float | None, longest_pause_s: float) -> float:
    """The hang timeout in force: the configured one, else derived from the pauses seen."""
    if configured is not None:
        return configured
    return max(MIN_DERIVED_S, PAUSE_FACTOR * longest_pause_s)


# Where a rank's main thread waits for the others (a collective, DDP's backward, the loop's
# periodic all-reduce): a rank found there is not the one that hangs.
WAITING = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/",
           "services/window_sync.py", "services/ckpt_writer.py")


def culprits(places: dict[int, str | None]) -> list[int]:
    """The ranks whose main thread is somewhere else than waiting for the others (a data
    set's read, the user's code): the ones the rest wait for. All of them when every rank
    waits (a collective that hangs everywhere)."""
    stuck = [r for r, p in sorted(places.items())
             if p and not any(w in p.rsplit("(", 1)[-1] for w in WAITING)]
    return stuck or sorted(places)


class HangWatch:
    """Rank 0's supervisor's watch over one generation's heartbeats (a thread; ``close()``
    ends it). ``on_hang(cause, rank)`` is called once, from the thread, with the report."""

    def __init__(self, rank: Rank, child_prefix: str, timeout_s: float | None,
                 logs: Path, ranks_dir: Path, stack_signal: int | None,
                 on_hang: Callable[[str, int], None]) -> None:
        self.rank, self.prefix, self.timeout_s = rank, child_prefix, timeout_s
        self.logs, self.ranks_dir, self.stack_signal = logs, ranks_dir, stack_signal
        self.on_hang = on_hang
        self.poll_s = heartbeat.interval(timeout_s, rank.env.world_size)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if rank.endpoint is not None and rank.env.is_master:
            self._thread = threading.Thread(target=self._run, name="hpc_ddp-hang-watch",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(10.0)
            self._thread = None

    def _run(self) -> None:
        assert self.rank.endpoint is not None
        try:
            own = rendezvous.client(self.rank.endpoint, 30)
        except Exception:
            return
        world = self.rank.env.world_size
        names = [rendezvous.prefixed(self.prefix, heartbeat.key(r)) for r in range(world)]
        seen: list[bytes] | None = None
        moved_at = longest = 0.0
        while not self._closed.wait(self.poll_s):
            try:
                if seen is None and not own.check(names):
                    continue  # not every rank has started stepping yet
                beats = [bytes(b) for b in own.multi_get(names)]
            except Exception:
                return  # the store is gone with the generation
            now = time.monotonic()
            if beats != seen:
                if seen is not None:  # a gap between beats is a pause only past the interval
                    longest = max(longest, now - moved_at - self.poll_s)
                seen, moved_at = beats, now
                continue
            allowed = limit(self.timeout_s, longest)
            first = any(b.split(b" ", 1)[0] == str(heartbeat.STARTING).encode()
                        for b in beats)
            if first:
                allowed *= FIRST_STEP_FACTOR  # compiling, warming up, the first batch
            if now - moved_at >= allowed:
                self._report(own, world, now - moved_at, allowed, first)
                return

    def _report(self, own: Any, world: int, still_s: float, allowed: float,
                first: bool = False) -> None:
        """Dump every rank's stacks, name the ones outside torch, and fail the generation."""
        places: dict[int, str | None] = {}
        if self.stack_signal is not None:
            stacks.request(PrefixedStore(self.prefix, own), list(range(world)),
                           self.ranks_dir, self.rank.host, self.stack_signal,
                           wait_s=STACKS_WAIT_S, logs=self.logs)
            places = {r: stacks.where(self.logs / f"rank{r}.stacks") for r in range(world)}
        named = culprits(places) if places else []
        hosts = hosts_of(self.ranks_dir, named[:8])
        said = "; ".join(f"rank {r} on {hosts.get(r, '?')} was in {places[r]}"
                         for r in named[:8] if places.get(r))
        more = f" (and {len(named) - 8} more)" if len(named) > 8 else ""
        how = f"trainer.hang_timeout_s={self.timeout_s:g}" if self.timeout_s is not None else (
            "derived from the pauses seen; set trainer.hang_timeout_s to choose it")
        if first:
            how += f", x{FIRST_STEP_FACTOR:g} before every rank's first step"
        cause = (f"hang: no rank's training moved for {still_s:.0f}s (limit {allowed:.0f}s, "
                 f"{how}){': ' + said + more if said else ''}")
        log.error("%s", cause)
        self.on_hang(cause, named[0] if named else 0)


def hosts_of(ranks_dir: Path, ranks: list[int]) -> dict[int, str]:
    """The hosts of a few ranks, from their rank records."""
    found = {}
    for r in ranks:
        try:
            found[r] = str(json.loads((ranks_dir / f"rank{r}.json").read_text())["host"])
        except (OSError, ValueError, KeyError):
            continue
    return found
