"""Fork a rank process from its node's warm process (server.py), starting that process first
when this is the node's first rank to ask.

Per node and launch there is one warm process: its socket's name is a hash of the launch (the
local launcher's id, or the Slurm job, step, attempt and node; a local run's warm process kept
for the next run is named by what it holds instead: kept.py), in a folder of this user's
alone (owned.private: $XDG_RUNTIME_DIR/hpc_ddp-warm, else /tmp/hpc_ddp-warm-UID). The first
rank to ask takes the folder's lock, starts the process and waits until it listens (its
imports: seconds); the others wait for the lock, then connect. The starter waits for the
warm process to leave before it exits itself (it leaves once no client is left), so it ends
inside the job step as every process of the step must (proctrack follows the process tree);
a kept one starts in a session of its own and is not awaited.
Whatever fails here (no such folder, the process cannot start) leaves the caller a reason, and
the rank starts cold, as a fresh interpreter, and says so in its log.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from hpc_ddp.owned import private
from hpc_ddp.rank.contract import LAUNCH_ID_ENV, WARM_ENV, WARM_SOCKET_ENV
from hpc_ddp.rank.warm import kept, tidy, wire

# The warm process imports torch and the rank program: seconds, a minute on a loaded node.
_READY_S = 180.0
# A warm process answers a client's "hold" at once (it serves requests between forks).
_HOLD_S = 30.0
_LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
# sun_path's size on Linux, less its final NUL.
_SUN_PATH = 107
# Variables of one rank that the node's warm process must not hold (it serves every rank).
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "SLURM_PROCID", "SLURM_LOCALID",
                   "SLURM_TASK_PID", "CUDA_VISIBLE_DEVICES", "HPC_DDP_STORE_KEY",
                   "HPC_DDP_PROGRAM_CONFIG", WARM_SOCKET_ENV)


def refused(environ: Mapping[str, str]) -> str | None:
    """Why this process may not start ranks warm (None: it may)."""
    wanted = environ.get(WARM_ENV, "1")
    if wanted == "0":
        return "cold: cluster.warm_start=false"
    if wanted not in ("1", "light"):
        return "cold: in a container (its runtime starts each rank's interpreter)"
    if not environ.get(LAUNCH_ID_ENV) and launch_key(environ) is None:  # (no key hashed)
        return "cold: not a launch of hpc_ddp's (no launch id or Slurm step to share with)"
    return None


def launch_key(environ: Mapping[str, str]) -> str | None:
    """What the ranks of one node of one launch share: a local launch's id, or the Slurm job,
    step, attempt and node (the test cluster's nodes share one /tmp)."""
    if environ.get(LAUNCH_ID_ENV):
        return kept.key(environ) or f"local {environ[LAUNCH_ID_ENV]}"
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    if job and step:
        node = environ.get("SLURMD_NODENAME") or socket.gethostname()
        return f"slurm {job} {step} {environ.get('SLURM_RESTART_COUNT', '0')} {node}"
    return None


def folder(environ: Mapping[str, str]) -> Path | None:
    runtime = environ.get("XDG_RUNTIME_DIR")
    for candidate in [*([Path(runtime) / "hpc_ddp-warm"] if runtime else []),
                      Path("/tmp") / f"hpc_ddp-warm-{os.geteuid()}"]:
        if len(os.fsencode(str(candidate))) + 22 < _SUN_PATH and private(candidate):
            return candidate
    return None


class WarmProc:
    """A forked process as subprocess.Popen shows one: pid, poll(), wait(), returncode, and
    the read end of its stderr when the caller asked for a pipe."""

    def __init__(self, sock: socket.socket, pid: int, stderr: IO[bytes] | None) -> None:
        self._sock = sock
        self.pid = pid
        self.stderr = stderr
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _read(self, timeout: float | None) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            ready, _, _ = select.select([self._sock], [], [], timeout)
            if not ready:
                return
            try:
                message, _ = wire.receive(self._sock)
            except wire.WireError:
                message = None
            # The warm process died (killed): its child was killed with it, or is lost.
            self.returncode = -signal.SIGKILL if message is None else int(message["exit"])
            self._sock.close()

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            try:
                self._read(left if left is not None else 1.0)
            except InterruptedError:  # pragma: no cover (PEP 475 retries)
                continue
        return self.returncode


class Warm:
    """This process's link to its node's warm process: a connection held for as long as it
    lives (the warm process stays while a client does), and the process itself when this
    one started it."""

    def __init__(self, path: Path, hold: socket.socket) -> None:
        self.path = path
        self._hold = hold

    def describe(self) -> dict[str, Any]:
        sock = wire.connect(self.path)
        with sock:
            wire.send(sock, {"op": "describe"})
            message, _ = wire.receive(sock)
        return message or {}

    def spawn(self, target: str, args: Sequence[str], argv: Sequence[str],
              environ: Mapping[str, str], fds: Sequence[int], pgid: int = 0,
              sigmask: Sequence[int] = (), ignored: Sequence[int] = (),
              stderr: IO[bytes] | None = None, title: Sequence[str] = ()) -> WarmProc:
        """Fork ``target`` (``module:function``, called with ``args``; its value the exit code)
        with this process's folder, umask, CPU affinity and ``sys.argv = argv``; ``title``:
        the command line ps shows for it (the one it would have been started with)."""
        sock = wire.connect(self.path)
        umask = os.umask(0)
        os.umask(umask)
        request = {"op": "spawn", "target": target, "args": list(args), "argv": list(argv),
                   "environ": dict(environ), "cwd": os.getcwd(), "umask": umask,
                   "affinity": sorted(os.sched_getaffinity(0)), "pgid": pgid,
                   "sigmask": sorted(int(s) for s in sigmask),
                   "ignored": sorted(int(s) for s in ignored),
                   "safe_path": bool(sys.flags.safe_path), "title": list(title),
                   "unbuffered": bool(environ.get("PYTHONUNBUFFERED"))}
        try:
            wire.send(sock, request, fds)
            answer, _ = wire.receive(sock)
        except OSError:
            sock.close()
            raise
        if answer is None or "pid" not in answer:
            sock.close()
            raise wire.WireError("the warm process did not fork")
        return WarmProc(sock, int(answer["pid"]), stderr)

    def close(self) -> None:
        """Let go; the starter waits for the warm process to leave (all its clients gone)."""
        with contextlib.suppress(OSError):
            self._hold.close()
        _wait_started()


def _hold(path: Path) -> socket.socket:
    """A link held for this process's life; it says so ("hold"), so that the warm process
    knows a client of its launch came (a bare connection may be another launch's tidy.sweep),
    and waits for its answer: a kept warm process that was leaving as this one connected
    closes the connection unanswered (then a new one is started)."""
    sock = wire.connect(path)
    try:
        wire.send(sock, {"op": "hold"})
        sock.settimeout(_HOLD_S)
        answer, _ = wire.receive(sock)
        sock.settimeout(None)
        if answer is None:
            raise ConnectionResetError(f"{path}: the warm process was leaving")
    except (OSError, wire.WireError) as exc:
        sock.close()
        raise ConnectionResetError(str(exc)) from exc
    return sock


def _place(environ: Mapping[str, str]) -> tuple[Path, Path] | str:
    """The socket and the lock of this launch's warm process on this node, or why none."""
    why = refused(environ)
    if why is not None:
        return why
    key = launch_key(environ)
    place = folder(environ)
    if place is None or key is None:
        return "cold: no private folder for the warm process's socket (/tmp/hpc_ddp-warm-UID)"
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    return place / f"{name}.sock", place / f"{name}.lock"


def start_early(environ: Mapping[str, str]) -> str | None:
    """Have this node's warm process start (here, when none is starting), without waiting
    for its imports: a supervisor joins its job meanwhile, and forks its training process
    there later (:func:`this_process`). None, or why not."""
    found = _place(environ)
    if isinstance(found, str):
        return found
    with contextlib.suppress(OSError):
        wire.connect(found[0]).close()
        return None
    return _start_once(*found, environ)


def connect(environ: Mapping[str, str]) -> Warm | str:
    """This node's warm process (started here when none serves this launch yet), once it
    listens, or why the rank starts cold."""
    found = _place(environ)
    if isinstance(found, str):
        return found
    link: Warm | str = ""
    for _ in range(3):  # a kept warm process may leave as this one comes: start another
        link = _connect_or_start(*found, environ)
        if not isinstance(link, str) or not link.endswith(_LEFT):
            break
    return link


_LEFT = "the warm process ended at its start"


def _connect_or_start(path: Path, lock_path: Path, environ: Mapping[str, str]) -> Warm | str:
    with contextlib.suppress(OSError):
        return Warm(path, _hold(path))
    why = _start_once(path, lock_path, environ)
    if why is not None:
        return why
    # The starting warm process holds the lock until it listens (or dies).
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            return Warm(path, _hold(path))
        if _STARTED is not None and _STARTED.poll() is not None:
            return f"cold: the warm process ended with exit code {_STARTED.returncode} at its start"
        if not tidy.locked(lock_path):
            with contextlib.suppress(OSError):
                return Warm(path, _hold(path))
            return f"cold: {_LEFT}"
        time.sleep(0.05)
    return f"cold: the warm process did not listen within {_READY_S:.0f} s"


def _start_once(path: Path, lock_path: Path, environ: Mapping[str, str]) -> str | None:
    """Start the warm process unless one is listening or starting: the first rank of the
    node takes the lock and hands it to the process it starts, which lets go once it
    listens; a rank that finds the lock taken waits for that. None, or why not."""
    global _STARTED
    try:
        lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        return f"cold: the warm process's lock: {exc}"
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a warm process starting holds it: wait
        with contextlib.suppress(OSError):
            wire.connect(path).close()
            return None
        tidy.sweep(path.parent, path)
        keep = kept.keep_seconds(environ)
        if keep:  # one idle kept warm process of this user at most: this one, soon
            tidy.evict_idle(path.parent, path)
        env = kept.shared_environment(environ) if keep else {
            k: v for k, v in environ.items() if k not in _RANK_VARIABLES}
        flags = ["-P"] if sys.flags.safe_path else []
        # The starter's line: closed when this process is done (release()), so a warm process
        # no rank came to (a supervisor that ended before its training) leaves at once.
        line, held = os.pipe()
        try:
            # A kept one outlives this run: a session of its own (a signal to this run's
            # process group is not for it), and no stream of this run's held open (a caller
            # reading them to their end would wait for it): its own log beside its socket.
            with open(os.open(path.with_suffix(".log"), _LOG_FLAGS, 0o600), "ab") if keep \
                    else contextlib.nullcontext(None) as log:
                _STARTED = subprocess.Popen(
                    [sys.executable, *flags, "-m", "hpc_ddp.rank.warm.server", str(path),
                     str(lock), str(line), *([f"{keep:g}"] if keep else [])], env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                    pass_fds=(lock, line), start_new_session=bool(keep))
        except OSError as exc:
            os.close(held)
            return f"cold: the warm process could not start: {exc}"
        finally:
            os.close(line)
        _STARTER_LINE.append(held)
        _STARTED_KEPT[:] = [bool(keep)]
        return None
    finally:
        os.close(lock)


def _wait_started() -> None:
    """The warm process this process started leaves once no client is left: wait for it, so
    that it ends inside the job step, with the process that started it."""
    global _STARTED
    while _STARTER_LINE:
        os.close(_STARTER_LINE.pop())
    if _STARTED is not None and not any(_STARTED_KEPT):  # a kept one stays for the next run
        _STARTED.wait()
        socket_path = Path(str(_STARTED.args[-3]))  # type: ignore[index]
        with contextlib.suppress(OSError):  # a later launch makes its own
            socket_path.with_suffix(".lock").unlink()
    _STARTED = None


def ignored_signals() -> list[int]:
    """The signals this process ignores: a process it starts would inherit that."""
    found = []
    for signum in signal.valid_signals():
        try:
            if signal.getsignal(signum) == signal.SIG_IGN:
                found.append(int(signum))
        except ValueError:
            continue
    return found


_THIS: Warm | str | None = None
# The warm process this process started (it waits for it before it exits: release()).
_STARTED: subprocess.Popen[bytes] | None = None
_STARTER_LINE: list[int] = []
_STARTED_KEPT: list[bool] = []


def this_process(environ: Mapping[str, str]) -> Warm | str:
    """The one link of this process (a supervisor forks every generation's training there)."""
    global _THIS
    if _THIS is None:
        _THIS = connect(environ)
    return _THIS


def release() -> None:
    """This process is done with the warm process: its link closed, and the one it started
    awaited."""
    global _THIS
    if isinstance(_THIS, Warm):
        _THIS.close()
    _THIS = None
    _wait_started()
