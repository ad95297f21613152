"""The stop signals that reach a task before its stop request is installed.

Slurm's warning ahead of the time limit (``--signal=USR2@T``) and a preemption's SIGTERM go
to every process of the step at the moment slurmctld decides
(https://slurm.schedmd.com/sbatch.html#OPT_signal): it may be while a task's interpreter
starts, while its node's warm process imports torch for it (rank/warm/thin.py waits) or while
its supervisor joins. With no handler yet, either signal ends the task (their default
action), the other tasks wait for it until the limit, and a job that should have been
requeued ends FAILED or TIMEOUT (seen with a 1-minute limit on a loaded machine).

So every task entry calls :func:`hold` first: from then on both signals are recorded, and the
task's stop request acts on them once it is installed (stopping.StopRequest.install). A
process a task starts for its program (a warm fork, a supervised child) starts with them
blocked, pending until its own :func:`hold` or stop request. Only the standard library here:
this runs before anything else is imported.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

# submitit's variable naming the requeue signal, in every task of a job it submitted
# (launch/slurm.py exports it); USR2 where it is not set (our sbatch wrappers, submitit's own
# default).
SIGNAL_ENV = "SUBMITIT_PREEMPT_SIGNAL"
DEFAULT = "USR2"

# The signals this process holds, and those that came while held, in order.
HELD: list[int] = []
RECORDED: list[int] = []


def record(signum: int, frame: Any) -> None:
    RECORDED.append(signum)


def held_signals(environ: Mapping[str, str]) -> list[int]:
    """The requeue signal the environment names (or USR2) and SIGTERM (pure)."""
    name = environ.get(SIGNAL_ENV, "").strip().upper() or DEFAULT
    found = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", None)
    requeue = found if isinstance(found, signal.Signals) else signal.SIGUSR2
    return sorted({int(requeue), int(signal.SIGTERM)})


def hold(environ: Mapping[str, str]) -> list[int]:
    """Record the stop signals from now on (not one this process was started ignoring: a
    launcher's choice) and take those that were pending, blocked by the process that started
    this one. Returns the signals held."""
    HELD[:] = [s for s in held_signals(environ) if signal.getsignal(s) is not signal.SIG_IGN]
    for signum in HELD:
        signal.signal(signum, record)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
    return list(HELD)


def take() -> list[int]:
    """The signals recorded so far, once: whoever takes them acts on them."""
    taken, RECORDED[:] = list(RECORDED), []
    return taken


def release(handled: set[int]) -> None:
    """Back to their default action: the held signals not in ``handled`` (a stop request
    for another requeue signal than the one held took over). One of them that came
    meanwhile is dropped with the others' record (taken by the caller)."""
    for signum in HELD:
        if signum not in handled and signal.getsignal(signum) is record:
            signal.signal(signum, signal.SIG_DFL)
    HELD[:] = [s for s in HELD if s in handled]
