"""The requeue signal again, for a step that Slurm's warning never reached.

``--signal=USR2@T`` goes to the job's *steps* (https://slurm.schedmd.com/sbatch.html#OPT_signal),
once, when slurmctld's periodic check finds the job within T seconds (plus the check's own
period: "up to 60 seconds earlier") of its limit. A step that does not exist yet at that
moment never gets it: a short time limit (the check may fire two seconds after the start), a
long setup before srun (staging data, pulling an image), or a step the driver starts again on
the nodes left after a node was lost (slurm/driver.py), after the warning went to the step
that was lost. The job then runs into its time limit and loses what it trained since its last
checkpoint, and is not requeued.

So rank 0's task (one process a job: no load on slurmctld that grows with the world size)
keeps the moment the warning is due at the latest. If by then this process has not been
signalled, it asks squeue how much time is left (the limit may have been changed with
``scontrol update``) and, when the limit is near, sends the signal to its own step with
``scancel --signal`` (https://slurm.schedmd.com/scancel.html#OPT_signal): every task of the
step gets it as it would have got Slurm's, a user's script too. Usually the warning arrives
first and no command runs at all.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hpc_ddp.rank.contract import JOB_END_ENV, PROGRAM_CONFIG_ENV, STEP_OF_ENV
from hpc_ddp.rank.services.stopping import signal_number, time_left_s
from hpc_ddp.slurm import relay

log = logging.getLogger(__name__)

# After the latest moment Slurm sends the warning (end - T): slurmctld's check runs late under
# load. A quarter of T at most, so the signal still comes well ahead of the limit.
GRACE_S = 15.0
# Not before this long after this process started: the other tasks of the step, started by
# the same srun, install their handlers first (rank/main/task.py signals_first); an uncaught
# USR2 would end a task.
SETTLE_S = 5.0
# Time left (squeue) that still counts as "the limit is near": the warning's T plus Slurm's
# own early margin.
NEAR_S = 60.0


@dataclass(frozen=True)
class Target:
    job: str
    step: str
    signal: str  # bare name, e.g. USR2
    delay_s: int


def target(environ: Mapping[str, str], rank: int, signal_name: str,
           delay_s: int) -> Target | None:
    """What to watch, on the task that should (pure): global rank 0 of a Slurm step, not a
    supervised child (its supervisor watches) and not a step inside someone's allocation."""
    job, step = environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_STEP_ID", "")
    if (rank != 0 or not job or not step.isdigit() or PROGRAM_CONFIG_ENV in environ
            or environ.get(STEP_OF_ENV)):
        return None
    return Target(job, step, signal_name.removeprefix("SIG"), delay_s)


def expected_end(environ: Mapping[str, str]) -> float | None:
    """The job's end (epoch seconds) where the environment says it: Slurm's own
    SLURM_JOB_END_TIME (newer Slurm) or the batch script's estimate (launch/slurm.py)."""
    for name in ("SLURM_JOB_END_TIME", JOB_END_ENV):
        text = environ.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return float(text)
    return None


def due(end: float, delay_s: int) -> float:
    """When the warning should have come by (pure)."""
    return end - delay_s + min(GRACE_S, delay_s / 4)


def decide(time_left: float | None, delay_s: int) -> float | None:
    """Send now (None), or the seconds until the warning is due again (pure): squeue's time
    left; None when squeue could not say, and the estimate stands."""
    if time_left is None or time_left <= delay_s + NEAR_S:
        return None
    return time_left - delay_s + min(GRACE_S, delay_s / 4)


class Watch:
    """The thread that keeps the moment; ``signalled``: whether this process has had a stop
    request (the warning, a preemption's signal, a cancel)."""

    def __init__(self, what: Target, signalled: Callable[[], bool],
                 time_left: Callable[[], float | None], send: Callable[[list[str]], str | None],
                 end: float | None, clock: Callable[[], float] = time.time,
                 wait: Callable[[float], bool] | None = None) -> None:
        self.what = what
        self._signalled = signalled
        self._time_left = time_left
        self._send = send
        self._end = end
        self._clock = clock
        self._started = clock()
        self._stop = threading.Event()
        # Sleeps that long; true when stopped meanwhile.
        self._wait = wait or self._stop.wait
        self.sent: list[str] = []

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="hpc_ddp-lost-signal", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        if self._end is None:
            # Neither Slurm nor the batch script said when the job ends (a plain sbatch
            # wrapper): one squeue, now.
            left = self._time_left()
            if left is None:
                return
            self._end = self._clock() + left
        wake = max(due(self._end, self.what.delay_s), self._started + SETTLE_S)
        while not self._wait(max(0.0, wake - self._clock())):
            if self._signalled():
                return
            again = decide(self._time_left(), self.what.delay_s)
            if again is None:
                self._deliver()
                return
            wake = self._clock() + again

    def _deliver(self) -> None:
        argv = ["scancel", "-s", self.what.signal, f"{self.what.job}.{self.what.step}"]
        failed = self._send(argv)
        self.sent.append(" ".join(argv))
        if failed:
            log.warning("Slurm's %s ahead of the time limit did not reach this step, and "
                        "sending it again failed (%s): the job will run into its limit",
                        self.what.signal, failed)
            return
        log.warning("Slurm's %s (%d s ahead of the time limit) did not reach this step: it was "
                    "sent before the step started (a short time limit or a long setup); sent "
                    "it again with `%s` (docs/fault-tolerance.md#what-happens-on-each-event)",
                    self.what.signal, self.what.delay_s, " ".join(argv))


def slurm_send(environ: Mapping[str, str]) -> Callable[[list[str]], str | None]:
    """Run a Slurm command (through the relay inside a container); None or what failed."""
    def send(argv: list[str]) -> str | None:
        try:
            done = relay.run(argv, environ, 30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
        # Where Slurm signals every process of the step, scancel (a child of this task) gets
        # the signal it asked for too: ended by it is sent.
        if done.returncode not in (0, -signal_number(argv[2])):
            return (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        return None

    return send


def watch(environ: Mapping[str, str], rank: int, signal_name: str, delay_s: int,
          signalled: Callable[[], bool]) -> Watch | None:
    """Start the watch on the task that should (see :func:`target`); None elsewhere."""
    what = target(environ, rank, signal_name, delay_s)
    if what is None:
        return None
    found = Watch(what, signalled, lambda: time_left_s(what.job, environ),
                  slurm_send(environ), expected_end(environ))
    found.start()
    return found
