"""How a submitted job is watched and ended, one control per launch target: the job-control
half of the seam whose submit half is launch/target.py (submitit's Job has the same three:
``state``, ``done``, ``cancel``). The API's Run, follow, status and ``status --stop`` ask
the job's control instead of testing its kind where each question is asked.

A control answers for one job, from its run dir and job.json's record (and submitit's
handle when this process submitted it):

- ``state(known)``: its state now (slurm/state.py's JobState); ``known``: the states of a
  status refresh's one query for many jobs, used where the kind is ``queried`` so;
- ``done()``: whether it has ended;
- ``cancel(check, grace_s)``: end it as cancelled, the ranks checkpointing first; True when
  something was cancelled. ``cancel_waits``: it returns once the job has ended (a process
  of this machine, killed after ``grace_s``), or at once (scancel: the ranks checkpoint
  and stop on their own, and a stop waits for the end itself);
- ``end_now(check)``: end what is left after a rank failed, at once and not as cancelled;
- ``poll_s``: how often a follower asks; ``follower_ends_failures``: a rank's failure ends
  the job only when its follower ends it (a local run), or the ranks requeue or end it
  themselves (Slurm).

:func:`ended` is the one answer to "is watching this job over", for every kind and for a
remote run's rows alike: it ended, or it can never start (its pending reason says so).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from hpc_ddp.procs import pid_alive
from hpc_ddp.rundir import RunDir, read_json, write_json

if TYPE_CHECKING:  # the type only: slurm.state stays off a local run's path
    from hpc_ddp.slurm.state import JobState

JOB_FILE = "job.json"
NOT_SUBMITTED = "NOT SUBMITTED"  # status's state of a run dir with no job.json


class JobControl(Protocol):
    """What every kind's control provides (the module doc says what each one means)."""

    job_id: str
    poll_s: ClassVar[float]
    follower_ends_failures: ClassVar[bool]
    cancel_waits: ClassVar[bool]
    queried: ClassVar[bool]

    def state(self, known: Mapping[str, JobState] | None = None) -> JobState: ...

    def done(self) -> bool: ...

    def cancel(self, check: bool = False, grace_s: float = 60.0) -> bool: ...

    def end_now(self, check: bool = False) -> None: ...


def ended(state: str, never: bool = False) -> bool:
    """Watching the job is over: an end state (Slurm's, or never submitted), or ``never``:
    it waits for what can never come (a pending reason no wait satisfies)."""
    from hpc_ddp.slurm.state import TERMINAL  # deferred (start-up): slurm.state

    return never or state in TERMINAL or state == NOT_SUBMITTED


def failed_ranks(run: RunDir) -> list[int]:
    """The ranks that left an error file (logs/rank<N>.error)."""
    if not run.logs.is_dir():
        return []
    return sorted(int(p.stem[4:]) for p in run.logs.glob("rank*.error") if p.stem[4:].isdigit())


class _Job:
    def __init__(self, run_dir: Path, record: dict[str, Any], handle: Any = None) -> None:
        self.run_dir, self.record, self.handle = run_dir, record, handle
        self.job_id = str(record["job_id"])


class SlurmJob(_Job):
    """A Slurm job (sbatch through submitit): asked of squeue, sacct after it ended."""

    poll_s: ClassVar[float] = 2.0  # one squeue a look: slurmctld's load, not ours
    follower_ends_failures: ClassVar[bool] = False  # the ranks requeue or end the job
    cancel_waits: ClassVar[bool] = False  # scancel returns at once
    queried: ClassVar[bool] = True  # status asks every job of a sweep in one squeue

    def state(self, known: Mapping[str, JobState] | None = None) -> JobState:
        # deferred (start-up): slurm.state, watch.ended
        from hpc_ddp.slurm.state import JobState
        from hpc_ddp.watch.ended import from_records, slurm_state

        if known is None:  # without accounting, an ENDED job told by its records
            return slurm_state(self.run_dir, self.record, self.job_id)
        return from_records(self.run_dir, self.record,
                            known.get(self.job_id) or JobState("UNKNOWN"))

    def done(self) -> bool:
        return self.state().finished

    def cancel(self, check: bool = False, grace_s: float = 60.0) -> bool:
        if self.done():
            return False
        self.end_now(check)
        return True

    def end_now(self, check: bool = False) -> None:
        from hpc_ddp.slurm.state import SlurmJobView  # deferred (start-up): slurm.state

        SlurmJobView(self.job_id).cancel(check=check)


class LocalJob(_Job):
    """submitit's local job: a controller process of this machine and its ranks."""

    poll_s: ClassVar[float] = 0.5  # a pid looked at: nothing to spare
    follower_ends_failures: ClassVar[bool] = True  # the others would wait in a collective
    cancel_waits: ClassVar[bool] = True  # SIGTERM, the checkpoint, then what is left killed
    queried: ClassVar[bool] = False

    def state(self, known: Mapping[str, JobState] | None = None) -> JobState:
        from hpc_ddp.slurm.state import JobState  # deferred (start-up): slurm.state

        if not self.done():
            return JobState("RUNNING")
        summary = read_json(RunDir(self.run_dir).summary)
        if isinstance(summary, dict) and not failed_ranks(RunDir(self.run_dir)):
            return JobState("COMPLETED")
        return JobState("CANCELLED" if self.record.get("cancelled") else "FAILED")

    def done(self) -> bool:
        if self.handle is not None:
            return bool(self.handle.done())
        return not self._alive()

    def cancel(self, check: bool = False, grace_s: float = 60.0) -> bool:
        if self.done() or not self._alive():
            return False
        self.record["cancelled"] = time.time()
        job = read_json(self.run_dir / JOB_FILE) or {}
        write_json(self.run_dir / JOB_FILE, {**job, "cancelled": self.record["cancelled"]})
        self._stop(grace_s)
        return True

    def end_now(self, check: bool = False) -> None:
        self._stop(0.0)

    def _alive(self) -> bool:
        """The controller runs (the same process: its pid may have been reused)."""
        return pid_alive(int(self.record.get("controller_pid", 0)),
                         self.record.get("controller_start"))

    def _stop(self, grace_s: float) -> None:
        from hpc_ddp.launch.local import stop  # deferred: hostlist

        stop(int(self.record["controller_pid"]), self.record.get("controller_start"), grace_s)


class StepJob(LocalJob):
    """A step of an allocation (srun on this machine): stopped through its tasks."""

    def _stop(self, grace_s: float) -> None:
        from hpc_ddp.launch import step  # deferred: the typed schemas

        step.stop(RunDir(self.run_dir), int(self.record["controller_pid"]),
                  self.record.get("controller_start"), grace_s, float(self.record["submitted"]))


# cluster.kind -> its control (launch/target.py's TARGETS has the same keys).
CONTROLS: dict[str, type[JobControl]] = {"slurm": SlurmJob, "local": LocalJob, "step": StepJob}


def control(run_dir: Path, record: dict[str, Any], handle: Any = None) -> JobControl:
    """The control of the job job.json's ``record`` names (a kind of no target: asked as a
    process of this machine, whose pid it does not hold: ended)."""
    kind: Any = CONTROLS.get(str(record.get("kind")), LocalJob)
    made: JobControl = kind(run_dir, record, handle)
    return made


def queried(record: Mapping[str, Any] | None) -> bool:
    """Whether a status refresh asks this job's state in its one query for many."""
    return record is not None and CONTROLS.get(str(record.get("kind")), LocalJob).queried
