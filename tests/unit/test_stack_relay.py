"""The supervisor's stack relay (rank/supervise/supervisor.py StackRelay), on the job's real
store (rank/join/authstore.py).

It signals its own training process when that rank's stacks are asked for, not when another
rank's are; and it ends before the supervisor exits. The last is what made supervised runs
that succeeded end FAILED on Slurm with torch's TCPStore: a relay thread still blocked in the
store was woken by the store's shutdown while the interpreter finalized, and the process
aborted (SIGABRT, srun's "task 1: Aborted", the job FAILED 6:0). The supervisor must exit 0
whether or not the relay was closed when its store goes away.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from hpc_ddp.rank.join import authstore, rendezvous, store_client, torch_store
from hpc_ddp.rank.services import stacks
from hpc_ddp.rank.supervise.supervisor import Child, StackRelay
from tests.conftest import REPO

# A training process that exits 7 on SIGUSR1 (the stack signal here), else after 60 s.
# Started with SIGUSR1 blocked, as the supervisor starts a training process: a request that
# comes before the handler exists waits for it instead of killing the child (no sleep to guess).
WAITS_FOR_USR1 = ("import signal, sys, time; "
                  "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(7)); "
                  "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1}); time.sleep(60)")


def _rank(store: Any, number: int) -> Any:
    """What the relay reads of a joined rank (join.Rank)."""
    endpoint = rendezvous.Endpoint("127.0.0.1", store.port, store._key)
    return SimpleNamespace(store=store, endpoint=endpoint,
                           env=SimpleNamespace(rank=number, restart=0, generation=0))


@pytest.fixture
def store() -> Any:
    """The supervisor's store client: plain (no torch in a supervisor)."""
    key = authstore.new_key()
    server = authstore.StoreServer(key, ["127.0.0.1"])
    return store_client.StoreClient("127.0.0.1", server.port, key, timedelta(seconds=30),
                                 server=server)


def child_keys(store: Any) -> Any:
    """The child's keys as its torch PrefixStore keeps them, on a torch client of the same
    store: the relay must find them under the same names."""
    return dist.PrefixStore(rendezvous.attempt_prefix(0), torch_store.AuthStore(
        store.host, store.port, store._key, timedelta(seconds=30)))


def _child() -> Child:
    return Child([sys.executable, "-c", WAITS_FOR_USR1], {},
                 blocked=frozenset({signal.SIGUSR1}))


def test_a_request_for_this_rank_signals_its_training_process(store: Any) -> None:
    child = _child()
    relay = StackRelay(_rank(store, 1), child, signal.SIGUSR1)
    stacks.request(child_keys(store), [1], Path("/nonexistent"), "elsewhere", signal.SIGUSR1,
                   wait_s=0)
    assert child.wait() == 7
    relay.close()
    assert relay._thread is not None and not relay._thread.is_alive()


def test_a_request_for_another_rank_leaves_it_alone_and_close_ends_the_thread(
        store: Any) -> None:
    child = _child()
    relay = StackRelay(_rank(store, 1), child, signal.SIGUSR1)
    stacks.request(child_keys(store), [2], Path("/nonexistent"), "elsewhere", signal.SIGUSR1,
                   wait_s=0)
    time.sleep(0.5)
    assert child.proc.poll() is None  # rank 2's request is not this rank's
    child.proc.kill()
    child.wait()
    started = time.monotonic()
    relay.close()
    assert relay._thread is not None and not relay._thread.is_alive()
    assert time.monotonic() - started < 5  # woken by its key, not by a timeout


@pytest.mark.parametrize("closed", [True, False])
def test_a_supervisor_whose_store_goes_away_while_it_exits_exits_cleanly(
        tmp_path: Path, closed: bool) -> None:
    """The failure as seen on Slurm, made deterministic: the store (rank 0's, in another
    process) goes away while this supervisor's interpreter finalizes. With the relay closed,
    and with it left blocked in the store, the process exits 0 (with the wait under torch's
    C++ frames the second case aborted: SIGABRT, or SIGSEGV through a PrefixStore)."""
    program = tmp_path / "supervisor.py"
    program.write_text(textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        from datetime import timedelta
        from types import SimpleNamespace
        from hpc_ddp.rank.join import authstore, rendezvous, store_client
        from hpc_ddp.rank.supervise.supervisor import Child
        from hpc_ddp.rank.supervise.supervisor import StackRelay

        key = authstore.new_key()
        server = subprocess.Popen([sys.executable, "-c", (
            "import sys, time; from hpc_ddp.rank.join import authstore as a; "
            f"s = a.StoreServer({{key!r}}, ['127.0.0.1']); "
            "print(s.port, flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
        port = int(server.stdout.readline())
        store = store_client.StoreClient("127.0.0.1", port, key, timedelta(seconds=30))
        rank = SimpleNamespace(store=store, endpoint=rendezvous.Endpoint("127.0.0.1", port, key),
                               env=SimpleNamespace(rank=1, restart=0, generation=0))
        child = Child([sys.executable, "-c", "pass"], {{}})
        relay = StackRelay(rank, child, signal.SIGUSR1)
        time.sleep(1.0)  # the relay is waiting in the store
        child.wait()
        if {closed!r}:
            relay.close()

        class StoreGoesAway:  # runs while the interpreter finalizes (module teardown)
            def __del__(self):
                server.kill()
                time.sleep(2)

        keep = StoreGoesAway()
    """))
    done = subprocess.run([sys.executable, str(program)], capture_output=True, text=True,
                          timeout=120, check=False, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_request_waits_until_every_asked_rank_wrote_its_stacks(tmp_path: Path) -> None:
    # A loaded node's dump can take seconds: the report waits for it (up to wait_s), and
    # returns as soon as every asked rank has written, not after the whole wait.
    import threading

    class NoStore:
        def multi_set(self, keys: Any, values: Any) -> None:
            pass

    for r in (0, 1):
        (tmp_path / f"rank{r}.stacks").write_text("")  # made at the rank's start, empty
    late = threading.Timer(1.0, lambda: (tmp_path / "rank1.stacks").write_text("Thread 0x1"))
    (tmp_path / "rank0.stacks").write_text("Current thread 0x2")
    started = time.monotonic()
    late.start()
    stacks.request(NoStore(), [0, 1], tmp_path, "elsewhere", signal.SIGUSR1, wait_s=20,
                   logs=tmp_path)
    took = time.monotonic() - started
    assert 1.0 <= took < 5, took
    assert (tmp_path / "rank1.stacks").read_text() == "Thread 0x1"
    started = time.monotonic()
    stacks.request(NoStore(), [2], tmp_path, "elsewhere", signal.SIGUSR1, wait_s=1.0,
                   logs=tmp_path)  # rank 2 never writes: the whole wait, then on
    assert 1.0 <= time.monotonic() - started < 3
