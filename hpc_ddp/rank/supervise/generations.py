"""Restart in place: the supervisors of a job step agree, one generation of training processes
at a time, whether their ranks start again from the latest checkpoint in the same job and
step, seconds after a failure, instead of a requeue that waits minutes (or hours) in the
queue (docs/fault-tolerance.md).

Every rank's supervisor runs its training process as generation 0, 1, 2, ... (the child's
store keys under a prefix of their own: rendezvous.attempt_prefix). Per generation, on the
supervisors' store (rank 0's supervisor holds it)::

    gen/<g>/failed          the first failure: who, where, why, when (json)
    gen/<g>/wake/<rank>     set for every rank (one multi_set) by the first failure
    gen/<g>/end/<rank>      how each rank's process ended (json: verdict, code, time)
    gen/<g>/ended           how many have ended (a counter); gen/<g>/all_ended once all have
    gen/<g>/decision        rank 0's supervisor's verdict: done | restart | requeue | fail | lost
    gen/<g>/acked           how many have read it (rank 0 keeps the store up until all have)

A supervisor whose child fails says so (the first one's record is kept) and wakes every
rank's: a thread in each supervisor waits on its own wake key (the store's own wait, no
polling) and kills its child, which would otherwise wait in a collective until its timeout.
Every supervisor then reports how its child ended; rank 0's decides once all have (or, for
a supervisor that never reports, its node is gone: not a restart in place), and every
supervisor acts on the decision. Each rank's work is a few store operations per generation,
whatever the world size; rank 0's supervisor reads the ends in one multi_get.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hpc_ddp.rank.join import rendezvous
from hpc_ddp.rank.join.joined import Rank
from hpc_ddp.slurm.requeue import job_nodes

log = logging.getLogger(__name__)

OK, RESTARTABLE, FINAL, STOPPED = "ok", "restartable", "final", "stopped"
DONE, RESTART, REQUEUE, FAIL, LOST = "done", "restart", "requeue", "fail", "lost"
# After a failure, how long rank 0's supervisor waits for every supervisor to report its
# child's end (they kill it at once: seconds); one that never does lost its node.
REPORT_WAIT_S = 30.0
# After a failure, how long it waits before it asks Slurm, once, whether the nodes of the
# ranks still silent are the job's: a node Slurm took out of the job (set DOWN, --no-kill:
# https://slurm.schedmd.com/sbatch.html#OPT_no-kill) is lost now, not after REPORT_WAIT_S.
NODE_CHECK_S = 3.0
# After a final failure (the program's own error), how long before the other ranks' processes
# are stopped.
FINAL_GRACE_S = 2.0
# After a clean end of rank 0's, how long it keeps the store up for the others' ends.
DONE_WAIT_S = 60.0
# After its decision, how long rank 0's supervisor keeps the store up for every supervisor
# to read it.
ACK_WAIT_S = 30.0


@dataclass(frozen=True)
class End:
    """How one rank's training process ended, as its supervisor saw it."""

    verdict: str  # OK, RESTARTABLE (a new start may get past it), FINAL, STOPPED (by us)
    at: float  # time.time() of the end
    code: int = 0  # the process's exit code (negative: the signal that ended it)
    cause: str = ""
    rank: int = 0
    host: str = ""
    # Every rank's process is stopped, this rank's too (a hang found by rank 0's watch: the
    # hung process is alive and must go as well).
    stop_all: bool = False
    # The training process's own report of its failure (outcome._tell_supervisor): the
    # program's frames, and the whole chain; "" when it said nothing (a crash).
    trace: str = ""
    full: str = ""
    # The failure reads as a consequence of another rank's (a lost peer, a collective that
    # failed with it): never the root cause while a rank failed by itself.
    symptom: bool = False

    def as_json(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def from_json(raw: bytes | str) -> End:
        data = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        return End(**data)


@dataclass(frozen=True)
class Decision:
    """Rank 0's supervisor's verdict on a generation, with its cause (the first failure)."""

    what: str  # DONE, RESTART, REQUEUE (the in-place budget is spent), FAIL, LOST
    root: End | None = None  # the failure that ended the generation (None: done)
    missing: tuple[int, ...] = ()  # ranks whose supervisor never reported (LOST)

    def as_json(self) -> str:
        return json.dumps({"what": self.what, "missing": list(self.missing),
                           "root": None if self.root is None else self.root.__dict__})

    @staticmethod
    def from_json(raw: bytes | str) -> Decision:
        data = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        root = End(**data["root"]) if data.get("root") else None
        return Decision(data["what"], root, tuple(data.get("missing", ())))


def slurm_nodes(rank: Rank, environ: Mapping[str, str]
                ) -> Callable[[], list[str] | None] | None:
    """Rank 0's supervisor's question to Slurm after a failure, when a rank stays silent
    (Generation.job_nodes); None off Slurm and on the other ranks."""
    job = environ.get("SLURM_JOB_ID")
    if not job or not rank.env.is_master:
        return None
    asked = dict(environ)

    def nodes() -> list[str] | None:
        return job_nodes(job, asked)

    return nodes


def key(generation: int, name: str) -> str:
    return f"hpc_ddp/gen/{generation}/{name}"


def cause_key(rank: int) -> str:
    """Where a supervised child leaves the message of its failure (outcome.fail)."""
    return f"hpc_ddp/cause/{rank}"


def decide(ends: dict[int, End | None], generation: int, budget: int,
           recorded: End | None = None) -> Decision:
    """Rank 0's verdict from every rank's end (None: its supervisor never reported) and the
    generation's recorded first failure (a hang's is no rank's end). Pure.

    The root cause is the earliest failure (a dead rank's supervisor sees the death before
    its peers' processes fail on the lost connection) of a rank that failed by itself, before
    any symptom (a peer lost: its supervisor may see it first); a process stopped by its
    supervisor after that is not a cause."""
    failures = sorted((e for e in [*ends.values(), recorded] if e is not None and e.verdict
                       in (RESTARTABLE, FINAL)), key=lambda e: (e.symptom, e.at))
    missing = tuple(sorted(r for r, e in ends.items() if e is None))
    root = failures[0] if failures else None
    if missing:
        return Decision(LOST, root, missing)
    if root is None:
        return Decision(DONE)
    if root.verdict == FINAL:
        return Decision(FAIL, root)
    return Decision(RESTART if generation < budget else REQUEUE, root)


class Generation:
    """One generation of this rank's training process, on the supervisors' store."""

    def __init__(self, rank: Rank, generation: int,
                 job_nodes: Callable[[], list[str] | None] | None = None) -> None:
        self.rank, self.generation = rank, generation
        self.store = rank.store
        # The nodes the job has now (one squeue; None: Slurm cannot say), asked by rank 0's
        # supervisor only when a rank is silent after a failure (None: not on Slurm).
        self.job_nodes = job_nodes
        self.child_prefix = rendezvous.attempt_prefix(rank.env.restart, generation)
        self.stopped_by_us = False
        self._watcher: threading.Thread | None = None
        # Every rank's end, once rank 0's supervisor has read them (for the summary).
        self.ends: dict[int, End | None] = {}

    def child_cause(self) -> dict[str, Any] | None:
        """What this rank's child said of its failure before it exited (outcome.fail, on
        its store: this generation's prefix), if it did: its cause, when it failed (``at``),
        the program's traceback (``trace``) and the whole chain (``full``)."""
        name = rendezvous.prefixed(self.child_prefix, cause_key(self.rank.env.rank))
        try:
            raw = bytes(self.store.get(name)).decode() if self.store.check([name]) else None
        except Exception:
            return None
        if raw is None:
            return None
        try:
            said = json.loads(raw)
        except ValueError:
            said = None
        return said if isinstance(said, dict) and "cause" in said else {"cause": raw}

    def end_of(self, verdict: str, code: int, cause: str = "",
               said: Mapping[str, Any] | None = None) -> End:
        """This rank's End, stamped now, or when its child said it failed (``said``: its
        child_cause), with the child's traceback."""
        if said is None:
            return End(verdict, time.time(), code, cause, self.rank.env.rank, self.rank.host)
        return End(verdict, float(said.get("at") or time.time()), code,
                   str(said.get("cause") or cause), self.rank.env.rank, self.rank.host,
                   trace=str(said.get("trace") or ""), full=str(said.get("full") or ""),
                   symptom=bool(said.get("symptom")))

    # -- the failure watch -----------------------------------------------------------------
    def watch(self, stop_child: Callable[[], None]) -> None:
        """A thread (its own store connection: a client serves one request at a time) that
        waits for this rank's wake key and stops this rank's child when another rank's
        failure set it."""
        if self.rank.endpoint is None or self.store is None:
            return
        endpoint, mine = self.rank.endpoint, key(self.generation, f"wake/{self.rank.env.rank}")

        def run() -> None:
            try:
                own = rendezvous.client(endpoint, 30)
                while True:
                    try:
                        own.wait([mine], timedelta(hours=1))
                        break
                    except Exception as exc:  # an hour without a failure, or the store is gone
                        if "timeout" not in str(exc).lower():
                            return
                if bytes(own.get(mine)) != _WAKE:
                    return  # closed by this supervisor: its child has ended
                failed = first_failure(own, self.generation)
                if failed is not None and (failed.rank != self.rank.env.rank
                                           or failed.stop_all):
                    log.warning("rank %d on %s failed (%s): stopping this rank's training "
                                "process", failed.rank, failed.host, failed.cause[:300])
                    self.stopped_by_us = True
                    stop_child()
            except Exception:
                return

        self._watcher = threading.Thread(target=run, name="hpc_ddp-generation-watch",
                                         daemon=True)
        self._watcher.start()

    def close_watch(self) -> None:
        """End the watch thread before this supervisor goes on: its wake key set to "closed"
        unless a failure set it (a thread left waiting in the store when the process ends
        can abort it: supervisor.StackRelay says why)."""
        if self._watcher is None:
            return
        try:
            self.store.compare_set(key(self.generation, f"wake/{self.rank.env.rank}"), "",
                                   "closed")
        except Exception:
            pass
        self._watcher.join(10.0)
        self._watcher = None

    # -- ends and the decision -------------------------------------------------------------
    def fail(self, end: End) -> bool:
        """This rank's child failed (or hung): the first failure of the generation is
        recorded and wakes every rank's supervisor (one multi_set). True if it was the
        first."""
        try:
            if int(self.store.add(key(self.generation, "failures"), 1)) != 1:
                return False
            self.store.set(key(self.generation, "failed"), end.as_json())
            if end.verdict == FINAL:
                # The program's own error, which every rank usually meets at once: a moment
                # for the others to end by themselves (each then reports its own error, said
                # once for all: hpc_ddp/watch/failures.py) before the rest are stopped.
                time.sleep(FINAL_GRACE_S)
            world = self.rank.env.world_size
            self.store.multi_set([key(self.generation, f"wake/{r}") for r in range(world)],
                                 [_WAKE] * world)
            return True
        except Exception:
            log.warning("the store is gone: rank 0's supervisor or its node died")
            return False

    def end(self, end: End, budget: int, clean_wait_s: float = DONE_WAIT_S) -> Decision:
        """Report how this rank's child ended; the decision for the generation (rank 0's
        supervisor makes it once every rank has reported). A store that is gone (rank 0's
        supervisor died with its node): LOST."""
        try:
            self.report(end)
            if self.rank.env.is_master:
                decision = self._decide(end, budget, clean_wait_s)
                self.store.set(key(self.generation, "decision"), decision.as_json())
                self._await_acks(decision)
                return decision
            self.store.wait([key(self.generation, "decision")],
                            timedelta(seconds=REPORT_WAIT_S + clean_wait_s + 30))
            decision = Decision.from_json(self.store.get(key(self.generation, "decision")))
            self.store.add(key(self.generation, "acked"), 1)
            return decision
        except Exception as exc:
            log.warning("no decision from rank 0's supervisor (%s): its node is gone", exc)
            return Decision(LOST, end if end.verdict != OK else None, (0,))

    def _await_acks(self, decision: Decision) -> None:
        """Keep the store (this process) up until every supervisor that reported has read
        the decision: one that lost the store before it would take rank 0's exit for a lost
        node. Rank 0 alone polls one counter, at most ACK_WAIT_S."""
        expected = self.rank.env.world_size - 1 - len(decision.missing)
        deadline = time.monotonic() + ACK_WAIT_S
        while expected > 0 and time.monotonic() < deadline:
            if int(self.store.add(key(self.generation, "acked"), 0)) >= expected:
                return
            time.sleep(0.05)

    def report(self, end: End) -> None:
        """This rank's end, on the store (the last to report releases rank 0's wait)."""
        self.store.set(key(self.generation, f"end/{self.rank.env.rank}"), end.as_json())
        if int(self.store.add(key(self.generation, "ended"), 1)) == self.rank.env.world_size:
            self.store.set(key(self.generation, "all_ended"), "1")

    def _decide(self, mine: End, budget: int, clean_wait_s: float) -> Decision:
        failed = self.store.check([key(self.generation, "failed")]) or mine.verdict != OK
        wait_s = REPORT_WAIT_S if failed else clean_wait_s
        first_s = min(wait_s, NODE_CHECK_S) if failed and self.job_nodes else wait_s
        if not self._all_ended(first_s) and not (first_s < wait_s and self._silent_lost()):
            if not self._all_ended(wait_s - first_s):
                log.warning("not every rank's supervisor reported within %.0fs", wait_s)
        world = self.rank.env.world_size
        names = [key(self.generation, f"end/{r}") for r in range(world)]
        # All there (the usual case): one multi_get; else the ones that are, one by one.
        present = names if self.store.check(names) else [
            n for n in names if self.store.check([n])]
        raw = dict(zip(present, self.store.multi_get(present), strict=True)) if present else {}
        self.ends = {r: End.from_json(raw[n]) if n in raw else None
                     for r, n in enumerate(names)}
        return decide(self.ends, self.generation, budget,
                      first_failure(self.store, self.generation))

    def _all_ended(self, wait_s: float) -> bool:
        """Whether every rank reported within ``wait_s`` (the store's wait: no polling)."""
        try:
            self.store.wait([key(self.generation, "all_ended")], timedelta(seconds=wait_s))
            return True
        except Exception:
            return False

    def _silent_lost(self) -> bool:
        """Whether Slurm took every silent rank's node out of the job (one squeue): their
        supervisors are gone with it, and no report will come."""
        world = self.rank.env.world_size
        silent = [r for r in range(world)
                  if not self.store.check([key(self.generation, f"end/{r}")])]
        nodes = self.job_nodes() if silent and self.job_nodes else None
        if not silent or nodes is None:
            return False
        placed = [_node_of(self.store, r) for r in silent]
        gone = sorted({n for n in placed if n is not None and n not in nodes})
        if None in placed or len(gone) != len(set(placed)):
            return False
        log.warning("node(s) %s left the job (Slurm): rank(s) %s will not report",
                    ",".join(gone), ",".join(map(str, silent)))
        return True


def _node_of(store: Any, rank: int) -> str | None:
    """The Slurm node ``rank`` checked in from (rank/join/checkin.py's record)."""
    try:
        record = json.loads(bytes(store.get(f"hpc_ddp/arrived/{rank}")).decode())
        return str(record.get("node") or record["host"])
    except Exception:
        return None


_WAKE = b"failed"


def first_failure(store: Any, generation: int) -> End | None:
    """The generation's first failure, if one was recorded."""
    try:
        if store.check([key(generation, "failed")]):
            return End.from_json(store.get(key(generation, "failed")))
    except Exception:
        pass
    return None
