"""How a Slurm job ended, from the run's own records, where Slurm can no longer say.

Without accounting (hpc_ddp/slurm/state.py's module doc) a job that left Slurm's queue is
ENDED and nothing more. Its run dir still says how: ``summary.json`` written after the
latest submission and no rank's error file is a completion; a rank's error file (or a
``failure`` event) of this submission is a failure; a ``stop`` event that was not followed
by a requeue, with no summary, is a cancel (a scancel's SIGTERM: the ranks checkpoint and
stop, docs/fault-tolerance.md). Anything else stays ENDED.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_ddp.rundir import read_json
from hpc_ddp.slurm.state import ENDED, JobState, query


def slurm_state(run_dir: Path, job: dict[str, Any] | None, job_id: str) -> JobState:
    """The Slurm job's state now (UNKNOWN while Slurm does not know it), an ENDED one told
    from the run's records."""
    return from_records(run_dir, job, query(job_id) or JobState("UNKNOWN"))


def from_records(run_dir: Path, job: dict[str, Any] | None, found: JobState) -> JobState:
    """``found`` (a job's state), told more precisely from the run dir's records when Slurm
    only knows that it ENDED."""
    if found.state != ENDED:
        return found
    from hpc_ddp import events  # deferred (start-up): events

    since = float((job or {}).get("submitted") or 0.0)
    said = "from the run's records; Slurm keeps none"
    errors = [p for p in (run_dir / "logs").glob("rank*.error") if _newer(p, since)]
    happened = [e for e in events.read(run_dir) if float(e.get("time") or 0.0) >= since]
    if errors or any(e.get("kind") == events.FAILURE for e in happened):
        return JobState("FAILED", raw=f"FAILED ({said})")
    if current_summary(run_dir, job):
        return JobState("COMPLETED", raw=f"COMPLETED ({said})")
    kinds = [e.get("kind") for e in happened]
    if kinds and kinds[-1] == events.STOP:
        return JobState("CANCELLED", raw=f"CANCELLED ({said}: stopped, not requeued)")
    return found


def _newer(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def current_summary(run_dir: Path, job: dict[str, Any] | None) -> dict[str, Any]:
    """summary.json, unless an earlier submission wrote it (a resumed run that trains now):
    older than job.json's latest submission, the rule follow.last_stop has for stops."""
    path = run_dir / "summary.json"
    summary = read_json(path)
    try:
        written = path.stat().st_mtime
    except OSError:
        return {}
    if not isinstance(summary, dict) or written < float((job or {}).get("submitted") or 0.0):
        return {}
    return summary
