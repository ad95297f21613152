"""A node's warm process: ``python -m hpc_ddp.rank.warm.server SOCKET``.

It imports torch and what a rank needs up to its first step once (PRELOAD), then forks every
rank process of its node that asks (rank/warm/client.py): each starts with those imports
done instead of paying them itself (~4 CPU-s a rank here; docs/performance.md). It never
initialises CUDA, makes no process group, reads no rank variable and starts no thread of its
own: what each process needs of its own it gets after the fork (forked.py). It answers only
this user's processes, ignores the signals meant for the ranks (Slurm signals every process
of a step; a local launcher, its ranks), and leaves as soon as it has neither a client nor a
child (its starter waits for that: rank/warm/client.py); a local run's warm process kept for the
next run (kept.py, cluster.warm_keep_s) leaves once it had neither for that long.

The client's connection is the child's lifeline: the child's exit status goes back on it, and
a client that goes away (killed) takes its child with it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import selectors
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpc_ddp.rank.warm import wire

# What a rank imports before its first step, measured (profiles of forked ranks of the
# built-in trainer and of a function entry import little more): torch, its distributed and
# compiler stacks (the first DDP constructor and optimizer step load Dynamo and Inductor),
# the rank program, and what every rank reads its config and its node's interfaces with
# (omegaconf: ~0.04 CPU-s a rank otherwise; psutil). TensorBoard is left to rank 0 (it would
# cost ~0.2 CPU-s on every node).
PRELOAD = (
    "torch", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch.utils.data",
    "torch._dynamo", "torch._inductor.config", "torch.distributed.checkpoint", "omegaconf",
    "psutil",
    "hpc_ddp.rank.main.task", "hpc_ddp.rank.main.submitted", "hpc_ddp.rank.main.step",
    "hpc_ddp.rank.main.script_runner", "hpc_ddp.rank.supervise.program",
    "hpc_ddp.rank.supervise.script", "hpc_ddp.trainer.loop", "hpc_ddp.rank.join.joined",
)
# Meant for the ranks, each of which has it too (SIGCHLD is this process's own).
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2, signal.SIGALRM, signal.SIGPIPE)
# No client within this long after the start: nobody came (the starter died).
_FIRST_CLIENT_S = 120.0
# A connection that has said nothing for this long is not a client that came.
_SILENT_S = 2.0
# A kept one idle this long leaves when a newer kept one starts (not one between two runs of a
# sweep or a script of runs: the next submit command takes seconds to come).
_EVICT_IDLE_S = 10.0
# How long it waits, with no client and no child, before it leaves.
_LINGER_S = 0.5


def preload() -> tuple[float, list[str]]:
    """Import PRELOAD; the seconds it took and what could not be imported (left to the rank,
    which says why when it needs it).

    The cyclic garbage collector stays off from here on in this process, and what the imports
    made is frozen: the imports make ~10^6 objects and no garbage worth a pass (a collection
    every few hundred allocations was ~15% of their CPU time, measured with PRELOAD), and a
    fork's collections then never write to the pages it shares with this process
    (https://docs.python.org/3/library/gc.html#gc.freeze; forked.py turns it on again)."""
    gc.disable()
    began = time.monotonic()
    missing = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    gc.freeze()
    return time.monotonic() - began, missing


class Server:
    def __init__(self, path: Path, keep_s: float = 0.0) -> None:
        self.path = path
        self.keep_s = keep_s  # kept for later local runs this long after its last client
        self.leaving = False  # asked to leave while idle (a newer kept one started)
        self.idle_since = time.monotonic()  # since when it has had no client and no child
        self.used_at = time.monotonic()  # when it last had a child or a client that spoke
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}  # pid -> its client's connection
        self.clients: set[socket.socket] = set()
        # When each client connected, until its first message: one that says nothing for
        # _SILENT_S (another launch's starter checking whether this one listens: tidy.sweep)
        # does not keep this process from leaving.
        self.silent: dict[socket.socket, float] = {}
        self.began = time.time()
        self.seen_client = False
        self.bound: tuple[int, int] | None = None  # the socket file this process made
        self.preload_s, self.missing = 0.0, list[str]()

    def start(self) -> socket.socket:
        # setproctitle finds the argv and environment memory it may rewrite at its first
        # call: here, before a fork changes its environment (forked.py titles each fork).
        import setproctitle  # deferred: the warm process's only

        setproctitle.setproctitle(setproctitle.getproctitle())

        for signum in _IGNORED:
            signal.signal(signum, signal.SIG_IGN)
        # Blocked too: a fork inherits the mask, not the pending signals, so one the step sends
        # a fork before it set its own signal state (forked.py) waits for that, where an
        # ignored one would be lost (a blocked signal is kept even while ignored: signal(7)).
        signal.pthread_sigmask(signal.SIG_BLOCK, set(_IGNORED) - {signal.SIGPIPE})
        self.preload_s, self.missing = preload()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the pipe
        self.wake = (wake_r, wake_w)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        old = os.umask(0o077)
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old)
        self.bound = _identity(self.path)
        listener.listen(256)
        self.listener = listener
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(wake_r, selectors.EVENT_READ, "wake")
        return listener

    def watch_starter(self, line: int) -> None:
        """The starter's line (a pipe): its end means the starter is done, and this process
        leaves once no client and no child is left, even if no rank ever came."""
        os.set_blocking(line, False)
        self.selector.register(line, selectors.EVENT_READ, "starter")

    def serve(self) -> None:
        self.idle_since = time.monotonic()
        while True:
            for key, _ in self.selector.select(timeout=0.25):
                if key.data == "accept":
                    self._accept()
                elif key.data == "starter":
                    with contextlib.suppress(BlockingIOError):
                        if not os.read(int(key.fd), 512):  # its end: the starter is done
                            self.selector.unregister(key.fd)
                            os.close(int(key.fd))
                            self.seen_client = True
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake[0], 512):
                            pass
                else:
                    self._request(key.fileobj)  # type: ignore[arg-type]
            self._reap()
            if self.leaving:
                return
            if self.children or any(c not in self.silent for c in self.clients):
                self.used_at = time.monotonic()  # a sweep's connection is no use
            if self.children or self._spoken():
                self.idle_since = time.monotonic()
                continue
            waited = time.monotonic() - self.idle_since
            linger = max(self.keep_s, _LINGER_S)
            if waited > (linger if self.seen_client else max(linger, _FIRST_CLIENT_S)):
                return

    def _spoken(self) -> bool:
        """A client holds this process: one that spoke, or connected only just now."""
        return any(self._spoke(c) for c in self.clients)

    def _spoke(self, conn: socket.socket) -> bool:
        now = time.monotonic()
        return now - self.silent.get(conn, now) < _SILENT_S

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if not wire.same_user(conn):  # the folder is ours alone; this is the second lock
            conn.close()
            return
        # Not yet a client that came (seen_client: at its first message, "hold" included):
        # another launch's starter sweeping stale sockets (tidy.sweep) connects and leaves
        # at once, and must not end this process before its own ranks come (the test
        # cluster's nodes, or one user's jobs on one node, share the folder).
        self.clients.add(conn)
        self.silent[conn] = time.monotonic()
        self.selector.register(conn, selectors.EVENT_READ, "client")

    def _request(self, conn: socket.socket) -> None:
        try:
            message, fds = wire.receive(conn)
        except wire.WireError:
            message, fds = None, []
        if message is None:
            self._gone(conn)
            return
        if message.get("op") != "leave":  # not a client that came: another's starter asking
            self.seen_client = True
            self.silent.pop(conn, None)
        try:
            if message.get("op") == "hold":  # answered: this process stays for it
                self.leaving = False
                wire.send(conn, {"held": True})
            elif message.get("op") == "leave":  # a newer kept one started (rank/warm/tidy.py)
                self.leaving = bool(self.keep_s) and not self.children and not any(
                    c is not conn and self._spoke(c) for c in self.clients) and (
                    time.monotonic() - self.used_at >= _EVICT_IDLE_S)
                wire.send(conn, {"leaving": self.leaving})
            elif message.get("op") == "describe":
                wire.send(conn, self.describe())
            elif message.get("op") == "spawn":
                wire.send(conn, {"pid": self._fork(conn, message, fds)})
        except OSError:
            self._gone(conn)
        finally:
            wire._close(fds)

    def _fork(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> int:
        request["socket"] = str(self.path)
        kept = (f", kept {self.keep_s:g} s after each run for the next: "
                f"cluster.warm_keep_s" if self.keep_s else "")
        note = (f"warm: forked from this node's warm process (pid {os.getpid()}, its imports "
                f"took {self.preload_s:.1f} s once{kept})")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        gc.freeze()  # what this process made since (preload's docstring)
        pid = os.fork()
        if pid == 0:
            # deferred (start-up): hpc_ddp.rank.warm.forked, in the fork only
            from hpc_ddp.rank.warm.forked import become

            others = [c.fileno() for c in self.clients] + [self.listener.fileno(), *self.wake,
                                                            self.selector.fileno()]  # type: ignore[attr-defined]
            become(request, fds, others, note)
        self.children[pid] = conn
        return pid

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None and conn in self.clients:
                with contextlib.suppress(OSError):
                    wire.send(conn, {"exit": os.waitstatus_to_exitcode(status), "pid": pid})

    def _gone(self, conn: socket.socket) -> None:
        """A client went away: a child it started has no one to report to, and is stopped
        (with its process group: its own data loader workers)."""
        self.clients.discard(conn)
        self.silent.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        for pid, owner in list(self.children.items()):
            if owner is conn:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(
                        pid, signal.SIGKILL)
        conn.close()

    def describe(self) -> dict[str, Any]:
        """What a test asks of the warm process: no CUDA, no rank, no thread of ours."""
        torch = sys.modules.get("torch")
        dist = sys.modules.get("torch.distributed")
        rank_vars = sorted(k for k in os.environ if k in (
            "RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID", "CUDA_VISIBLE_DEVICES"))
        return {"pid": os.getpid(), "preload_s": self.preload_s, "missing": self.missing,
                "keep_s": self.keep_s,
                "cuda_initialized": bool(torch is not None and torch.cuda.is_initialized()),
                "process_group": bool(dist is not None and dist.is_available()
                                      and dist.is_initialized()),
                "rank_variables": rank_vars, "python_threads": _python_threads(),
                "devices_open": _devices_open(), "modules": len(sys.modules),
                "gc_enabled": gc.isenabled(), "gc_frozen": gc.get_freeze_count()}


def _python_threads() -> int:
    return threading.active_count()


def _devices_open() -> list[str]:
    """GPU device files this process holds open (a CUDA context holds /dev/nvidia*)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/dev/nvidia"):
                found.append(target)
    return found


def main(argv: list[str]) -> int:
    try:
        keep_s = float(argv[3]) if len(argv) == 4 else 0.0
    except ValueError:
        keep_s = -1.0
    if len(argv) not in (1, 3, 4) or not all(a.isdigit() for a in argv[1:3]) or keep_s < 0:
        print("usage: python -m hpc_ddp.rank.warm.server SOCKET [LOCK_FD LINE_FD [KEEP_S]] "
              "(started by a rank of a run: rank/warm/client.py)", file=sys.stderr)
        return 2
    server = Server(Path(argv[0]), keep_s)
    server.start()
    if len(argv) >= 3:  # the starter's lock, held while this imported: listening now
        os.close(int(argv[1]))
        server.watch_starter(int(argv[2]))
    try:
        server.serve()
    finally:
        # Only its own socket: a later warm process of the launch (started after this one
        # had no client left) may have bound the name since.
        with contextlib.suppress(OSError):
            if _identity(server.path) == server.bound:
                server.path.unlink()
        log = server.path.with_suffix(".log")  # a kept one's (client._start_once), if empty
        with contextlib.suppress(OSError):
            if keep_s and log.stat().st_size == 0:
                log.unlink()
    return 0


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        found = os.lstat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
