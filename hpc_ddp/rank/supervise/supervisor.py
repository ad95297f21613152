"""The supervisor: what a rank does when its training runs in a child process it outlives.

One skeleton for a user's script (supervise/script.py) and for the built-in trainer or a
function entry on GPUs (supervise/program.py). The supervisor joins the job as every rank
does (rendezvous, NCCL settings, GPU choice, the rank record) but makes no process group and
never touches the GPU; rank 0's holds the store. It starts the training process with the
torchrun variables pointing at that store and ``TORCHELASTIC_USE_AGENT_STORE=True``, so
``init_process_group`` in the child joins it as under torchrun (no port to pick, none to
collide); waits for it; tells rank 0's supervisor it ended; and rank 0's keeps the store up
until every rank's training has ended. What a given end means is the caller's to decide.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch.distributed as dist

from hpc_ddp.rank.contract import STORE_KEY_ENV
from hpc_ddp.rank.join import rendezvous
from hpc_ddp.rank.join.joined import Rank
from hpc_ddp.rank.services import stacks, stopping
from hpc_ddp.rank.services.stopping import StopRequest

log = logging.getLogger(__name__)
# Seconds rank 0's supervisor keeps the store up for the other ranks' scripts to finish.
DONE_WAIT_S = 60.0


_TAIL_LINES = 30


# Deaths no script chooses: a new attempt may get past them.
ABRUPT = {signal.SIGKILL, signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL,
           signal.SIGFPE}


def report_done(rank: Rank, code: int) -> None:
    try:
        rank.store.set(f"hpc_ddp/script_exit/{rank.env.rank}", str(code))
        rank.store.add("hpc_ddp/script_done", 1)
    except Exception:  # rank 0's store is gone (its supervisor died): nothing to tell
        pass


def wait_for_all(rank: Rank, stop: StopRequest | None = None) -> None:
    """Keep the store (in this process) up until every rank's script has ended, so none of
    them loses its store in its last collectives; not past a SIGTERM (Slurm ends the step:
    a rank that hangs would hold this one until KillWait's SIGKILL)."""
    deadline = time.monotonic() + DONE_WAIT_S
    while time.monotonic() < deadline and not (stop and stop.code == stopping.TERM):
        try:
            if int(rank.store.add("hpc_ddp/script_done", 0)) >= rank.env.world_size:
                return
        except Exception:
            return
        time.sleep(0.2)
    if time.monotonic() >= deadline:
        log.warning("not every rank's program ended within %.0fs of rank 0's", DONE_WAIT_S)


class Child:
    """The script's process: stdout passed through, stderr passed through and its last lines
    kept (for the error report)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv = argv
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE)
        self._copier = threading.Thread(target=self._copy_stderr, daemon=True)
        self._copier.start()

    def _copy_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
            self._tail.append(raw.decode(errors="replace").rstrip())

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def wait(self) -> int:
        code = self.proc.wait()  # signal handlers run meanwhile (PEP 475 retries the wait)
        self._copier.join(timeout=5)
        return code

    def tail(self) -> str:
        return "\n".join(self._tail) or "(nothing on stderr)"


def exit_codes(rank: Rank) -> dict[str, int | None]:
    """Every rank's script exit code (rank 0 reads them once, at the end)."""
    codes: dict[str, int | None] = {}
    for r in range(rank.env.world_size):
        key = f"hpc_ddp/script_exit/{r}"
        try:
            codes[str(r)] = int(rank.store.get(key)) if rank.store.check([key]) else None
        except Exception:
            codes[str(r)] = None
    return codes


def child_environment(rank: Rank, environ: Mapping[str, str],
                      extra: Mapping[str, str]) -> dict[str, str]:
    """The training process's environment: this task's (with the NCCL settings applied),
    the torchrun variables of this rank, the agent-store flag, the store's key (for the
    child's client: rank/join/authstore.py) and ``extra``."""
    env = {**environ, **rank.torchrun_env(), "TORCHELASTIC_USE_AGENT_STORE": "True", **extra}
    if rank.endpoint is not None:
        env[STORE_KEY_ENV] = rank.endpoint.key
    env.setdefault("PYTHONUNBUFFERED", "1")  # its log lines as they happen, as submitit's -u
    return env


def run_child(rank: Rank, argv: list[str], env: dict[str, str], stop: StopRequest, *,
              stack_signal: int | None = None,
              started: Callable[[Child], None] | None = None) -> tuple[int, Child]:
    """Run the training process to its end: (its exit code, the child). ``stack_signal``:
    the signal that makes it dump its stacks, relayed when a stack request for this rank
    comes (a child that registered it: the trainer's and an entry's, not a user's script);
    ``started``: called with the child once it runs (e.g. to pass on a signal that came
    while joining)."""
    child = Child(argv, env)
    relay = StackRelay(rank, child, stack_signal) if stack_signal is not None else None
    if started is not None:
        started(child)
    try:
        code = child.wait()
    finally:
        if relay is not None:
            relay.close()
    report_done(rank, code)
    if rank.env.is_master:
        wait_for_all(rank, stop)
    return code, child


class StackRelay:
    """A thread that waits for a stack request for this rank (rank/services/stacks.py) on a
    connection of its own (a store client is not shared between threads) and signals the
    child when it comes. Waiting is the store's own (no polling).

    :meth:`close` ends the thread before this process exits, by setting the key itself (to
    stacks.DONE) and joining it. A thread left blocked in a store under torch's C++ frames
    (TCPStore's wait, or a PrefixStore's) would be woken by the store's shutdown (rank 0's
    process ending) while this interpreter finalizes; it then cannot take the GIL, is unwound
    through those frames and the process aborts ("terminate called without an active
    exception", SIGABRT): srun reports the task Aborted and Slurm ends a run that finished
    FAILED. So the thread also asks the store's Python client directly, for the key the
    child's PrefixStore uses (rendezvous.prefixed): no C++ frame is on its stack.
    """

    def __init__(self, rank: Rank, child: Child, signum: int) -> None:
        self._child, self._signum = child, signum
        self._store = rank.store
        self._prefix = rendezvous.attempt_prefix(rank.env.restart)  # the child's keys
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
            dist.PrefixStore(self._prefix, self._store).set(self._key, stacks.DONE)
        except Exception:  # the store is gone: the thread's wait has failed and it returns
            pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the stack relay thread did not end within %.0fs", timeout_s)
