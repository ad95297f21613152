"""A rank's stdout and stderr, and those of every process it starts, into its log.

:func:`capture` makes fds 1 and 2 of this process pipes into a tee process
(rank/join/tee.py) that writes each line into ``logs/rank<N>.log`` beside hpc_ddp's own lines,
and passes it on to where the output went before: submitit's per-task files, an sbatch job's
``logs/slurm-<jobid>.out``, a terminal. So the program's output of every rank can be read in
one place, by rank, whoever started the rank (submitit, srun, a supervisor), and
``python -m hpc_ddp.logs`` reads only the ranks it is asked for (docs/observability.md).

Once per process: a supervisor's child (a user's script, the trainer under a supervisor)
writes into the same pipes, which it inherits, and does not capture again (CAPTURED_ENV).
Each start of the rank writes an ATTEMPT line first (the launch, Slurm's restart count, the
generation of a restart in place: DistEnv.attempt), so the log of a requeued run shows where
each attempt begins.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import MutableMapping
from pathlib import Path

from hpc_ddp.owned import open_append
from hpc_ddp.rank.contract import CAPTURED_ENV
from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.ranklines import ATTEMPT, attempt_text, line
from hpc_ddp.redact import NO_MARKS, Marks

# Blocked while the tee starts: a stop signal in that moment waits for this process (it is
# delivered right after) and cannot end the tee before it ignores it (tee.IGNORED).
_BLOCKED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGCONT, signal.SIGQUIT}
# Seconds this process waits at its exit for the tee to write what is left.
DRAIN_S = 5.0


class Capture:
    """The tee of this process: its pid, and this process's own stdout/stderr before."""

    def __init__(self, proc: subprocess.Popen[bytes], saved: tuple[int, int]) -> None:
        self.proc = proc
        self.saved = saved

    def close(self, timeout_s: float = DRAIN_S) -> None:
        """This process's fds 1 and 2 back where they were (its ends of the pipes closed),
        then wait for the tee to write the rest; at exit (atexit)."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, saved in zip((1, 2), self.saved, strict=True):
            with contextlib.suppress(OSError):
                os.dup2(saved, fd)
                os.close(saved)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)  # sooner, once no child holds the pipes any more


_current: dict[int, Capture] = {}  # pid -> its capture (a fork has none of its own)


def capture(path: Path, env: DistEnv, host: str, environ: MutableMapping[str, str],
            marks: Marks = NO_MARKS) -> bool:
    """Write this process's output (and its children's) into ``path``, the log of rank
    ``env.rank``, from now on; start with an ATTEMPT line. False where it is not done: a
    process whose output a parent captures already, or no fd 1 or 2 to capture."""
    if os.getpid() in _current:
        return False
    if environ.get(CAPTURED_ENV) == str(path):
        # A supervised program: its output goes through its supervisor's tee already. A
        # restart in place (generation 1, 2, ...) marks where its lines begin.
        if env.generation:
            _append(path, line(env.rank, host, ATTEMPT, attempt_text(*env.attempt)))
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    _append(path, line(env.rank, host, ATTEMPT, attempt_text(*env.attempt)))
    try:
        saved = (os.dup(1), os.dup(2))
    except OSError:
        return False
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    argv = [sys.executable, "-m", "hpc_ddp.rank.join.tee", str(path), str(env.rank), host,
            str(out_read), str(err_read),
            json.dumps({"secret": sorted(marks.secret), "public": sorted(marks.public)})]
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=saved[0],
                                stderr=saved[1], pass_fds=(out_read, err_read),
                                env=dict(environ))
    except OSError:
        for fd in (*saved, out_read, out_write, err_read, err_write):
            os.close(fd)
        return False
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.dup2(out_write, 1)
    os.dup2(err_write, 2)
    for fd in (out_read, out_write, err_read, err_write):
        os.close(fd)
    # A line as soon as it is printed, also where Python was started without -u.
    with contextlib.suppress(Exception):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    environ[CAPTURED_ENV] = str(path)
    _current[os.getpid()] = Capture(proc, saved)
    atexit.register(_close, os.getpid())
    return True


def _close(pid: int) -> None:
    if os.getpid() == pid and pid in _current:
        _current.pop(pid).close()


def _append(path: Path, text: str) -> None:
    fd = open_append(path)  # no link, no one else's file (owned.py)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
