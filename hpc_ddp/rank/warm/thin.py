"""A task that runs its program in a fork of its node's warm process and waits for it.

submitit (locally and on Slurm) and ``submit`` inside an allocation start each task as
``python -m hpc_ddp.rank.main.submitted|step``: that process imports nothing heavy; it asks
the node's warm process (client.py) to fork the same module's ``main`` with its own standard
streams, environment, folder, signal state and process group, and exits as the fork does (with
its exit code, or killed by the same signal). Signals to the task itself (a local launcher's
SIGTERM, SIGUSR2, Ctrl-C's SIGINT) are passed on; in a Slurm step, where slurmstepd signals
every process of the step, the fork has them already and the task only waits. One that came
before the fork existed (while this task waited for its warm process to import torch) is
passed on once it does; the fork starts with the stop signals blocked until it holds them
(rank/services/early_signals.py).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from types import FrameType

from hpc_ddp.rank.contract import WARM_ENV, WARM_NOTE_ENV, WARM_SOCKET_ENV
from hpc_ddp.rank.join.distenv import step_signals_every_process
from hpc_ddp.rank.services import early_signals
from hpc_ddp.rank.services.process_exit import STOPPING
from hpc_ddp.rank.warm import client

# WARM_ENV's value for a task that is a supervisor (config/supervision.py).
LIGHT = "light"
# What a launcher or a user sends a task (stop, requeue, stack dumps, terminal signals).
RELAYED = (*STOPPING, signal.SIGCONT)


def run_forked(target: str, args: Sequence[str], argv: Sequence[str]) -> int | None:
    """Run ``target(args)`` in a warm fork and wait: its exit code (negative: killed by that
    signal). None: run it here instead (this is the fork, or warm starts are off or failed;
    then WARM_NOTE_ENV says why, for the rank's log)."""
    if WARM_SOCKET_ENV in os.environ:
        return None
    if os.environ.get(WARM_ENV) == LIGHT:
        # A supervisor (it imports no torch): it runs here at once and joins the job while
        # the warm process imports; its training process is forked there (spawn.py).
        why = client.start_early(os.environ)
        if why is not None:
            os.environ[WARM_NOTE_ENV] = why
        return None
    warm = client.connect(os.environ)
    if isinstance(warm, str):
        os.environ[WARM_NOTE_ENV] = warm
        return None
    ignored = client.ignored_signals()
    # The fork starts with the stop signals this task holds blocked, pending until it holds
    # them itself (early_signals.py): one the step sends it meanwhile is not its end.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, []) | set(early_signals.HELD)
    relay = not step_signals_every_process(os.environ)
    child: list[int] = []
    pending: list[int] = []

    def passed_on(signum: int, frame: FrameType | None) -> None:
        if child:
            if not relay:
                return  # the step signalled the fork itself
            try:
                os.kill(child[0], signum)
            except ProcessLookupError:
                pass
        else:  # no fork yet to have it: passed on once it exists
            pending.append(signum)

    previous = {s: signal.signal(s, passed_on) for s in RELAYED if s not in ignored}
    # Those that came while this task started and waited for its warm process.
    pending.extend(early_signals.take())
    try:
        proc = warm.spawn(target, args, argv, os.environ, (0, 1, 2), pgid=os.getpgid(0),
                          sigmask=sorted(mask), ignored=ignored, title=_own_command())
    except OSError as exc:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        early_signals.RECORDED.extend(s for s in pending if s in early_signals.HELD)
        warm.close()
        os.environ[WARM_NOTE_ENV] = f"cold: the warm process did not fork this rank: {exc}"
        return None
    child.append(proc.pid)
    for early in pending:
        os.kill(proc.pid, early)
    code = proc.wait()
    warm.close()
    return code


def _own_command() -> list[str]:
    """This process's command line (the fork shows it too: ps, pgrep -f)."""
    try:
        raw = open("/proc/self/cmdline", "rb").read()  # noqa: SIM115 (one read)
    except OSError:
        return []
    return [w.decode(errors="replace") for w in raw.split(b"\0") if w]


def leave_as(code: int) -> int:
    """The task's own end as the fork's: its code, or death by the same signal."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        return 128 - code  # a signal this process cannot die of (ignored by its parent)
    return code
