"""The supervisor: what a rank does when its training runs in a child process it outlives.

One skeleton for a user's script (supervise/script.py) and for the built-in trainer or a
function entry on GPUs (supervise/program.py). The supervisor joins the job as every rank
does (rendezvous, NCCL settings, GPU choice, the rank record) but makes no process group and
never touches the GPU; rank 0's holds the store. It starts the training process with the
torchrun variables pointing at that store and ``TORCHELASTIC_USE_AGENT_STORE=True``, so
``init_process_group`` in the child joins it as under torchrun (no port to pick, none to
collide); waits for it; tells rank 0's supervisor how it ended; and rank 0's keeps the store
up until every rank's training has ended. When one rank's training fails in a way a new start
may get past, every supervisor stops its child and all start again from the latest checkpoint,
in the same job and step, within ``cluster.restarts_in_place`` (generations.py). What a
given end means is the caller's to judge (``classify``) and act on.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from hpc_ddp.rank.contract import (
    COLD_NOTE,
    GENERATION_ENV,
    STORE_KEY_ENV,
    WARM_NOTE_ENV,
    WARM_SOCKET_ENV,
)
from hpc_ddp.rank.join import rendezvous
from hpc_ddp.rank.join.joined import Rank
from hpc_ddp.rank.join.store_client import PrefixedStore
from hpc_ddp.rank.services import stacks, stopping
from hpc_ddp.rank.services.stopping import StopRequest
from hpc_ddp.rank.supervise import generations
from hpc_ddp.rank.warm.client import WarmProc
from hpc_ddp.rank.warm.spawn import forked_child

log = logging.getLogger(__name__)
# The last stderr lines of a training process kept for its error report.
_TAIL_LINES = 30


# Deaths no script chooses: a new attempt may get past them.
ABRUPT = {signal.SIGKILL, signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL,
           signal.SIGFPE}


class Child:
    """The script's process: stdout passed through, stderr passed through and its last lines
    kept (for the error report)."""

    def __init__(self, argv: list[str], env: dict[str, str],
                 blocked: frozenset[int] = frozenset()) -> None:
        """``blocked``: signals the process starts with blocked (pending until it handles
        them: slurmstepd signals every process of the step, and one that came while the
        training process imported torch would end it before its handler exists)."""
        self.argv = argv
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        # Forked from the node's warm process where it can be (rank/warm/), else started.
        self.proc: subprocess.Popen[bytes] | WarmProc = forked_child(argv, env, blocked) \
            or self._started(argv, env, blocked)
        # How it started (rank/warm/), for the supervisor's log.
        self.start_note = "warm: forked from this node's warm process" if isinstance(
            self.proc, WarmProc) else env.get(WARM_NOTE_ENV, COLD_NOTE)
        self._copier = threading.Thread(target=self._copy_stderr, daemon=True)
        self._copier.start()

    @staticmethod
    def _started(argv: list[str], env: dict[str, str],
                 blocked: frozenset[int]) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in env.items() if k != WARM_SOCKET_ENV}  # a fresh interpreter
        # The child inherits this thread's signal mask across exec.
        before = signal.pthread_sigmask(signal.SIG_BLOCK, blocked) if blocked else None
        try:
            # A process group of its own: stopping it stops its data loader workers too.
            return subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, process_group=0)
        finally:
            if before is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)

    def _copy_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
            self._tail.append(raw.decode(errors="replace").rstrip())

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def kill(self) -> None:
        """Stop it now, with everything it started (another rank failed: it would wait in a
        collective until its timeout; its checkpoints are atomic, nothing is lost)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self) -> int:
        code = self.proc.wait()  # signal handlers run meanwhile (PEP 475 retries the wait)
        self._copier.join(timeout=5)
        return code

    def tail(self) -> str:
        return "\n".join(self._tail) or "(nothing on stderr)"


def exit_codes(decision_ends: dict[int, generations.End | None]) -> dict[str, int | None]:
    """Every rank's exit code, as the last generation's ends say (rank 0 reads them once)."""
    return {str(r): None if e is None else e.code for r, e in sorted(decision_ends.items())}


def child_environment(rank: Rank, environ: Mapping[str, str],
                      extra: Mapping[str, str], generation: int = 0) -> dict[str, str]:
    """The training process's environment: this task's (with the NCCL settings applied),
    the torchrun variables of this rank (its restart count: requeues and restarts in place),
    the agent-store flag, the store's key (for the child's client: rank/join/authstore.py),
    its generation and ``extra``."""
    env = {**environ, **rank.torchrun_env(), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": str(rank.env.restart + generation),
           GENERATION_ENV: str(generation), **extra}
    if rank.endpoint is not None:
        env[STORE_KEY_ENV] = rank.endpoint.key
    env.setdefault("PYTHONUNBUFFERED", "1")  # its log lines as they happen, as submitit's -u
    return env



def last_lines(tail: str) -> str:
    """"; its last lines:" and them, or that it printed nothing (a report never ends in a
    heading with nothing under it)."""
    return f"; its last lines:\n{tail}" if tail.strip() else " (it printed nothing)"


@dataclass(frozen=True)
class Supervised:
    """How the supervised training ended: the last generation's child, its exit code, and
    the supervisors' decision on it."""

    code: int
    child: Child
    decision: generations.Decision
    ends: dict[int, generations.End | None]
    generation: int = 0
    end: generations.End | None = None  # this rank's, as classified


Classify = Callable[[int, Child, generations.Generation], generations.End]


class Closes(Protocol):
    def close(self) -> None: ...


def run_generations(rank: Rank, command: Callable[[int, str | None], tuple[list[str],
                    dict[str, str]]], classify: Classify, stop: StopRequest, budget: int, *,
                    stack_signal: int | None = None,
                    started: Callable[[Child], None] | None = None,
                    on_restart: Callable[[generations.Decision, int], None] | None = None,
                    watch: Callable[[generations.Generation], Closes] | None = None,
                    blocked: frozenset[int] = frozenset(),
                    job_nodes: Callable[[], list[str] | None] | None = None) -> Supervised:
    """Run the training process, generation by generation, to its end.

    ``command(generation, resume_cause)``: its argv and environment; ``classify(code,
    child, generation)``: how it ended (generations.End); ``budget``: restarts in place
    allowed; ``stack_signal``: the signal that makes it dump its stacks, relayed when a stack
    request for this rank comes (a child that registered it: the trainer's and an entry's,
    not a user's script); ``started``: called with each child once it runs (e.g. to pass
    on a signal that came while joining); ``on_restart``: rank 0's, called with the decision
    and the next generation before the restart (the record of it); ``watch``: started with
    each generation (rank 0's hang watch: hangs.py), closed when its child has ended;
    ``blocked``: the signals each child starts with blocked until it handles them (Child);
    ``job_nodes``: rank 0's question to Slurm for a silent rank's node (generations.py)."""
    generation, cause = 0, None
    while True:
        argv, env = command(generation, cause)
        gen = generations.Generation(rank, generation, job_nodes)
        child = Child(argv, env, blocked)
        log.info("generation %d: process %d, %s", generation, child.proc.pid, child.start_note)
        # How the rank's training started, for the summary a supervisor writes (a script's).
        os.environ[WARM_NOTE_ENV] = child.start_note
        gen.watch(child.kill)
        relay = StackRelay(rank, child, stack_signal, gen.child_prefix) \
            if stack_signal is not None else None
        if started is not None:
            started(child)
        watching = watch(gen) if watch is not None else None
        try:
            code = child.wait()
        finally:
            if watching is not None:
                watching.close()
            if relay is not None:
                relay.close()
            gen.close_watch()
        end = classify(code, child, gen)
        if end.verdict in (generations.RESTARTABLE, generations.FINAL):
            gen.fail(end)
        if stop.code == stopping.TERM:  # Slurm ends the step: no time to wait for the rest
            gen.report(end)
            return Supervised(code, child, generations.Decision(generations.DONE), {},
                              generation, end)
        decision = gen.end(end, budget)
        if decision.what != generations.RESTART or stop.code != stopping.NONE:
            return Supervised(code, child, decision, gen.ends, generation, end)
        root = decision.root
        assert root is not None
        if rank.env.is_master and on_restart is not None:
            on_restart(decision, generation + 1)
        generation += 1
        cause = f"restart in place after rank {root.rank} on {root.host}: {root.cause}"
        log.warning("restarting every rank's training in place (generation %d of at most "
                    "%d): %s", generation, budget, cause[:300])


class StackRelay:
    """A thread that waits for a stack request for this rank (rank/services/stacks.py) on a
    connection of its own (a store client is not shared between threads) and signals the
    child when it comes. Waiting is the store's own (no polling).

    :meth:`close` ends the thread before this process exits, by setting the key itself (to
    stacks.DONE) and joining it, so that no thread is left blocked in the store while the
    interpreter finalizes. The thread asks the store's plain client (no torch in this
    process) for the key the child's PrefixStore uses (rendezvous.prefixed).
    """

    def __init__(self, rank: Rank, child: Child, signum: int, prefix: str | None = None
                 ) -> None:
        self._child, self._signum = child, signum
        self._store = rank.store
        # The child's keys (its generation's).
        self._prefix = prefix or rendezvous.attempt_prefix(rank.env.restart, rank.env.generation)
        self._key = stacks.request_key(rank.env.rank)
        self._thread: threading.Thread | None = None
        if rank.endpoint is not None and rank.store is not None:
            self._thread = threading.Thread(target=self._relay, args=(rank.endpoint,),
                                            name="hpc_ddp-stack-relay", daemon=True)
            self._thread.start()

    def _relay(self, endpoint: rendezvous.Endpoint) -> None:
        try:
            own = rendezvous.client(endpoint, 30)
            key = rendezvous.prefixed(self._prefix, self._key)
            while self._child.proc.poll() is None:
                try:
                    own.wait([key], timedelta(hours=1))
                except Exception as exc:  # an hour without a request, or the store is gone
                    if "timeout" not in str(exc).lower():
                        return
                    continue
                if own.get(key).decode() == stacks.REQUEST:
                    self._child.signal(self._signum)
                return
        except Exception:
            return

    def close(self, timeout_s: float = 10.0) -> None:
        """End the thread (the child has ended): set this rank's key, then join."""
        if self._thread is None:
            return
        try:
            PrefixedStore(self._prefix, self._store).set(self._key, stacks.DONE)
        except Exception:  # the store is gone: the thread's wait has failed and it returns
            pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the stack relay thread did not end within %.0fs", timeout_s)
