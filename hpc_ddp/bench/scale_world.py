"""One rank of a simulated world of N ranks: hpc_ddp's own code paths, counted (recording.py).

A :class:`World` is a run dir laid out as N ranks leave it (a record, a log and a stream
folder per rank, a checkpoint of the whole world), and each scenario runs the real functions
one rank calls (``Context.save``/``load``, ``outcome.after_failure``, ``task.resume_cause``)
for one rank, with a :class:`~hpc_ddp.bench.recording.RecordingStore` seeded with what the
other ranks would have written, and returns what that rank cost. Nothing is re-implemented:
a change that makes a rank read every rank's file or key shows up as a count that grows with
N (tests/unit/test_scale_cost.py).

A new scenario is a function ``(world, rank) -> Cost`` added to :data:`SCENARIOS`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpc_ddp import events
from hpc_ddp.bench.recording import RecordingStore, recording
from hpc_ddp.config.schema import Config
from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.rundir import RunDir

STEP = 10  # the step of the world's checkpoint
JOB = "4242"


@dataclass(frozen=True)
class Cost:
    """What one rank did."""

    store_ops: int
    store_bytes: int
    file_ops: int
    file_bytes: int
    entries_listed: int
    slurm_calls: int

    @staticmethod
    def columns() -> tuple[str, ...]:
        return ("store ops", "store B", "file ops", "file B", "dir entries", "slurm calls")

    def values(self) -> tuple[int, ...]:
        return (self.store_ops, self.store_bytes, self.file_ops, self.file_bytes,
                self.entries_listed, self.slurm_calls)


def address(rank: int, per_node: int) -> str:
    node = rank // per_node
    return f"10.{node // 65536 % 256}.{node // 256 % 256}.{node % 256 + 1}"


class World:
    """A run dir as ``size`` ranks (``per_node`` a node) leave it; ``ranks``: the ranks
    whose stream files of the world's checkpoint exist (the ones a test simulates)."""

    def __init__(self, root: Path, size: int, ranks: tuple[int, ...], per_node: int = 8) -> None:
        # deferred: torch; start-up: rank.services.checkpoint, rank.services.rng
        import torch

        from hpc_ddp.rank.services import checkpoint, rng

        self.size, self.per_node = size, per_node
        self.run = RunDir(root / f"world{size}")
        for folder in (self.run.ranks, self.run.logs, self.run.checkpoints):
            folder.mkdir(parents=True, exist_ok=True)
        streams = self.run.checkpoints / checkpoint.STREAMS
        streams.mkdir()
        records, own = str(self.run.ranks), str(streams)
        for r in range(size):  # what a glob or a loop over the ranks would find
            fd = os.open(f"{records}/rank{r}.json", os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, json.dumps({"rank": r, "host": self.host(r), "pid": 0, "addresses": {
                "eth0": [address(r, per_node)]}}).encode())
            os.close(fd)
            os.mkdir(f"{own}/rank{r}")
        state = {"user": {"step": STEP, "w": torch.zeros(16)},
                 "hpc_ddp": {"step": STEP, "world_size": size, "restarts": [], "program": "x"}}
        checkpoint.save(state, self.run.checkpoints, STEP, keep=3)
        for r in ranks:
            checkpoint.write_streams(self.run.checkpoints, r, STEP, rng.capture({}))
        self.reset()
        self.cfg = Config()
        self.cfg = replace(self.cfg, trainer=replace(self.cfg.trainer,
                                                     checkpoint_background=False))

    def reset(self) -> None:
        """The run's history as the world's last attempt left it (each scenario starts so)."""
        (self.run.root / events.FILE).write_text(
            json.dumps({"kind": events.STOP, "attempt": 0, "job": JOB, "step": STEP}) + "\n")

    def host(self, rank: int) -> str:
        return f"node{rank // self.per_node:05d}"

    def env(self, rank: int, restart: int = 0) -> DistEnv:
        return DistEnv(rank=rank, local_rank=rank % self.per_node, world_size=self.size,
                       node_rank=rank // self.per_node, num_nodes=-(-self.size // self.per_node),
                       local_world_size=self.per_node, source="slurm", job_id=f"{JOB}.0",
                       restart=restart)

    def measure(self, work: Callable[[], Any], store: RecordingStore) -> Cost:
        self.reset()
        with recording(self.run.root) as (files, _clock, slurm):
            with contextlib.suppress(RuntimeError, SystemExit):
                work()
        c = files.counts
        return Cost(store.ops, store.sent + store.received, c.total,
                    c.bytes_read + c.bytes_written, c.entries_listed, slurm.total)


@contextlib.contextmanager
def _group_store(store: RecordingStore) -> Iterator[None]:
    # deferred (start-up): rank.services.ckpt_writer
    from hpc_ddp.rank.services import ckpt_writer

    saved = ckpt_writer.group_store
    ckpt_writer.group_store = lambda: store
    try:
        yield
    finally:
        ckpt_writer.group_store = saved


def _context(world: World, rank: int) -> Any:
    # deferred: torch; start-up: rank.context.context
    import torch

    from hpc_ddp.rank.context.context import Context

    return Context(world.cfg, world.run, world.env(rank), torch.device("cpu"), world.host(rank),
                   None)


def checkpoint_save(world: World, rank: int) -> Cost:
    """``ctx.save`` at a checkpoint step (the trainer's save_checkpoint calls the same
    writer): rank 0 with the other ranks' parts already counted in."""
    # deferred: torch
    import torch

    store = RecordingStore()
    store.seed_prefix("hpc_ddp/checkpoint/", world.size - 1)  # the others' "mine is written"
    ctx = _context(world, rank)
    with _group_store(store):
        return world.measure(lambda: ctx.save({"step": 2 * STEP, "w": torch.ones(16)}), store)


def checkpoint_resume(world: World, rank: int) -> Cost:
    """``ctx.load`` at a resume: the latest checkpoint and this rank's own streams."""
    store = RecordingStore()
    ctx = _context(world, rank)
    return world.measure(ctx.load, store)


def _rank(world: World, rank: int, store: RecordingStore) -> Any:
    # deferred: hostlist, torch
    import torch

    from hpc_ddp.rank.join.joined import Rank

    return Rank(world.env(rank), world.host(rank), torch.device("cpu"), [], store)


def _after_failure(world: World, rank: int, store: RecordingStore, error: Exception) -> Cost:
    # deferred: hostlist
    from hpc_ddp.rank.supervise.outcome import after_failure

    who = _rank(world, rank, store)
    return world.measure(lambda: after_failure(error, world.cfg, who, world.run,
                                               {"SLURM_JOB_ID": JOB}), store)


def failure_peer_silent(world: World, rank: int) -> Cost:
    """A collective timed out: the last rank hangs, the others report. Rank 0 checks in first
    (it names the silent rank and requeues); any other finds the reporter there."""
    store = RecordingStore()
    silent = world.size - 1
    store.seed("hpc_ddp/failed/ranks", "".join(f"{r}," for r in range(world.size)
                                               if r not in (silent, rank)))
    if rank != 0:
        store.seed("hpc_ddp/failed/count", 1)
        store.seed("hpc_ddp/failed/reporter", 0)
        store.seed("hpc_ddp/failure/0", 1)
    error = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                         "20000ms for recv operation to complete")
    return _after_failure(world, rank, store, error)


def failure_store_gone(world: World, rank: int) -> Cost:
    """Rank 0 died and its store with it: every survivor's store call fails. One rank (the
    fallback reporter: the first of the second node) reports and requeues."""
    error = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                         f"[{address(0, world.per_node)}]:29500")
    return _after_failure(world, rank, RecordingStore(dead=True), error)


def failure_own(world: World, rank: int) -> Cost:
    """This rank raised by itself (a bug in a loss): it says so on the store and records it."""
    return _after_failure(world, rank, RecordingStore(), ValueError("loss is not a tensor"))


def start_up(world: World, rank: int) -> Cost:
    """The start of a requeued attempt: why it resumes (task.resume_cause), and whether rank 0
    refused the run dir (join.claim_run_dir: one store read on the others)."""
    # deferred: hostlist
    from hpc_ddp.rank.join import joined as join
    from hpc_ddp.rank.main.task import resume_cause

    store = RecordingStore()
    store.seed("hpc_ddp/run_dir_refused", "")
    env = world.env(rank, restart=1)

    def work() -> None:
        resume_cause(world.cfg, world.run, env, JOB)
        if rank != 0:  # rank 0 claims the run dir with an squeue call: rank/join/owner.py
            join.claim_run_dir(world.run, env, world.host(rank), {}, store)

    return world.measure(work, store)


def rendezvous_join(world: World, rank: int) -> Cost:
    """Joining the rendezvous (rank/join/rendezvous.py): reading rank 0's endpoint file, then the
    check-in on its store, as the last rank to arrive (which also releases the others'
    waits); the TCP connection itself is left out (one per rank, as a TCPStore makes it)."""
    # deferred (start-up): rank.join.checkin, rank.join.rendezvous
    from hpc_ddp.rank.join import checkin, rendezvous

    store = RecordingStore()
    store.seed("hpc_ddp/arrived", world.size - 1)  # the others have announced themselves
    env = world.env(rank)
    path = rendezvous.endpoint_file(world.run.rendezvous, env)
    rendezvous.publish(path, rendezvous.Endpoint(address(0, world.per_node), 29500, "n"),
                       world.host(0))

    def work() -> None:
        assert rendezvous.read_endpoint(path) is not None
        checkin.check_in(store, env, json.dumps({"host": world.host(rank)}), 60.0)

    return world.measure(work, store)


SCENARIOS: dict[str, Callable[[World, int], Cost]] = {
    "rendezvous (endpoint file, check-in)": rendezvous_join,
    "start-up (requeued attempt)": start_up,
    "checkpoint (ctx.save / trainer)": checkpoint_save,
    "resume (ctx.load)": checkpoint_resume,
    "failure: a peer hangs": failure_peer_silent,
    "failure: rank 0 and its store die": failure_store_gone,
    "failure: this rank's own error": failure_own,
}


def designated(world: World) -> dict[str, int]:
    """The one rank per scenario whose cost may grow with the world, and why it may."""
    # deferred (start-up): rank.supervise.diagnose
    from hpc_ddp.rank.supervise.diagnose import fallback_reporter

    return {"failure: a peer hangs": 0,  # reads the survivors' list once (one store get)
            "failure: rank 0 and its store die": fallback_reporter(
                world.env(0).num_nodes, world.per_node, world.size)}
