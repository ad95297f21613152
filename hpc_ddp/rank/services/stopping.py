"""Stopping cleanly on a signal: every rank at the same step, then a checkpoint, then exit.

A signal handler only sets a flag. At step boundaries the ranks agree through a collective
(MAX of their flags), so all of them stop after the same step and none is left waiting
inside a collective the others never enter. Then rank 0 checkpoints, and the job requeues
itself or exits (see rank/main/task.py).

Signals: the requeue signal (``cluster.signal``, USR2 by default) arrives ahead of the time
limit (``--signal=USR2@T``) and, with ``preempt_send_user_signal``, at a preemption. SIGTERM
arrives at a preemption's GraceTime or a ``scancel``. USR1 is avoided: NCCL 2.12-2.13 caught
it in its proxy thread, which is why submitit moved to USR2
(https://github.com/facebookincubator/submitit/pull/1697).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from hpc_ddp.rank.services import early_signals
from hpc_ddp.slurm.requeue import squeue_job

log = logging.getLogger(__name__)

# Agreed codes, ordered: the strongest request wins the MAX reduction.
NONE, TERM, REQUEUE = 0, 1, 2


class StopTraining(Exception):
    """Raised by the trainer after the agreed stop's checkpoint; carries the signal's code."""

    def __init__(self, code: int, step: int | None) -> None:
        super().__init__(f"stopped at step {step} on {'SIGTERM' if code == TERM else 'requeue'}")
        self.code = code
        self.step = step


class StopRequest:
    """The flag the signal handlers set (handlers do nothing else, besides passing the signal
    on where asked: to a script's process, or to the handler a script installed before)."""

    def __init__(self) -> None:
        self.code = NONE
        self.received: list[tuple[str, float]] = []
        self._chained: dict[int, Any] = {}
        self._forward: Callable[[int], None] | None = None

    def install(self, requeue_signal: str, chain: bool = False,
                forward: Callable[[int], None] | None = None) -> None:
        """Handle the requeue signal and SIGTERM. ``chain``: also call the Python handlers
        installed before (a script's own); ``forward``: pass each signal on to it too."""
        self._forward = forward
        for signum, handler in ((signal_number(requeue_signal), self._on_requeue),
                                (signal.SIGTERM, self._on_term)):
            previous = signal.signal(signum, handler)
            if chain and callable(previous):
                self._chained[signum] = previous
        # Slurm sends SIGCONT with the SIGTERM that ends a requeued or cancelled job
        # (https://slurm.schedmd.com/scancel.html); it only resumes a stopped process, and
        # submitit's handler for it logs "Bypassing signal SIGCONT" as a warning. Its default
        # action again (any other handler, a script's own, is left alone).
        if is_submitit_bypass(signal.getsignal(signal.SIGCONT)):
            signal.signal(signal.SIGCONT, signal.SIG_DFL)
        # A supervised training process starts with both blocked (supervise/supervisor.py
        # Child): one that came while it started is pending, and handled now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal_number(requeue_signal),
                                                    signal.SIGTERM})
        # One that came before, while the task started (early_signals.py); a held signal
        # this request does not handle (another requeue signal was configured) is Slurm's
        # default again.
        handled = {signal_number(requeue_signal), int(signal.SIGTERM)}
        early_signals.release(handled)
        for signum in early_signals.take():
            if signum == signal_number(requeue_signal):
                self._on_requeue(signum, None)
            elif signum == signal.SIGTERM:
                self._on_term(signum, None)

    def forward_to(self, forward: Callable[[int], None] | None) -> None:
        """Pass each signal handled from now on to ``forward`` too (installed already)."""
        self._forward = forward

    def _on_requeue(self, signum: int, frame: Any) -> None:
        self.code = max(self.code, REQUEUE)
        self.received.append((signal.Signals(signum).name, time.time()))
        self._pass_on(signum, frame)

    def _on_term(self, signum: int, frame: Any) -> None:
        self.code = max(self.code, TERM)
        self.received.append(("SIGTERM", time.time()))
        self._pass_on(signum, frame)

    def _pass_on(self, signum: int, frame: Any) -> None:
        if self._forward is not None:
            self._forward(signum)
        if signum in self._chained:
            self._chained[signum](signum, frame)


def is_submitit_bypass(handler: Any) -> bool:
    """submitit's handler that only logs a signal (submitit/core/job_environment.py)."""
    return getattr(handler, "__qualname__", "") == "SignalHandler.bypass"


def signal_number(name: str) -> int:
    """USR2 or SIGUSR2 -> the signal's number."""
    return int(getattr(signal, name if name.startswith("SIG") else f"SIG{name}"))


def signal_of(code: int, requeue_signal: str) -> int:
    """The signal that asks for stop ``code`` (TERM or REQUEUE; pure)."""
    return int(signal.SIGTERM) if code == TERM else signal_number(requeue_signal)


def agree(code: int, device: Any) -> int:
    """The strongest stop request of any rank (a collective: every rank must call it)."""
    # deferred: torch
    import torch
    import torch.distributed as dist

    flag = torch.tensor([code], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def time_left_s(job_id: str, environ: Mapping[str, str]) -> float | None:
    """Seconds until the job's time limit, from squeue (None when Slurm cannot say)."""
    done = squeue_job(job_id, "%L", environ)
    return parse_duration(done.stdout.strip()) if done and done.returncode == 0 else None


def parse_duration(text: str) -> float | None:
    """Slurm's [D-]HH:MM:SS, MM:SS or SS in seconds; None for UNLIMITED, INVALID or junk."""
    days, _, clock = text.rpartition("-")
    fields = clock.split(":")
    if not 1 <= len(fields) <= 3:
        return None
    try:
        hours, minutes, seconds = [0] * (3 - len(fields)) + [int(f) for f in fields]
        total = int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds
    except ValueError:
        return None
    return float(total)


def cause_of(code: int, time_left: float | None, signal_delay_s: int,
             on_slurm: bool = True) -> str:
    """What the stop was: a time limit ahead, a preemption, or a cancel/preemption SIGTERM."""
    if code == TERM:
        return ("SIGTERM (preemption grace time or scancel)" if on_slurm else
                "SIGTERM (Ctrl-C on the submitting command, a cancel, or kill)")
    if at_time_limit(time_left, signal_delay_s):
        return "time limit"
    return "preemption or a signal sent by hand"


def at_time_limit(time_left: float | None, signal_delay_s: int) -> bool:
    """Whether the requeue signal came for the time limit: with ``time_left`` (squeue's
    %L) about ``signal_delay_s``. Far more left is a preemption (preempt_send_user_signal)
    or a signal sent by hand; unknown (None) is not the time limit."""
    # --signal=SIG@T may arrive up to 60 s earlier than T (sbatch(1)).
    return time_left is not None and time_left <= signal_delay_s + 90


def requeue_signal_said(name: str, time_left: float | None, signal_delay_s: int) -> str:
    """The requeue signal ``name`` in words, by :func:`cause_of`'s rule (a script that did
    not handle it is told why it came): "SIGUSR2, the requeue signal (sent 120s before the
    time limit)", or "(sent at a preemption or by hand, 59m55s before the time limit)"."""
    if at_time_limit(time_left, signal_delay_s):
        return f"{name}, the requeue signal (sent {signal_delay_s}s before the time limit)"
    from hpc_ddp.slurm.cost import hours  # deferred (start-up): slurm.cost

    when = f"{hours(time_left)} before" if time_left else "not for"
    return f"{name}, the requeue signal (sent at a preemption or by hand, {when} the time limit)"
