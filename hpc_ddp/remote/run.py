"""A run on a remote cluster, from a notebook on the laptop: the questions :class:`Run` answers,
asked over the handle's SSH connection.

    run = hpc_ddp.submit(["cluster=slurm", "cluster.remote=login", "nodes=4", ...])
    run.wait()                      # progress lines, then the summary (collected here)
    run.scalars()["train/loss"]     # read from the collected TensorBoard files
    run = hpc_ddp.open_run("outputs/2026-12-04_20-15-02-113")   # after a kernel restart

Every question is hpc_ddp's own command on the login node (``status --json``, ``logs``,
``status --stop``), forwarded as the command line forwards it (hpc_ddp/remote/handle.py);
results are read from what :func:`hpc_ddp.remote.results.collect` copied into the handle.
A connection lost while waiting is tried again; the run never notices.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.api import RunFailed, scalars_in
from hpc_ddp.errors import UserError
from hpc_ddp.launch.control import NOT_SUBMITTED, ended
from hpc_ddp.remote import handle as handles
from hpc_ddp.remote.results import Collected, collect
from hpc_ddp.rundir import read_json

RETRY_S = 5.0
POLL_S = 5.0  # one SSH round trip and a status there a look


class RemoteRun:
    """The run (or sweep) behind a local handle (``remote.json``)."""

    kind = "remote"

    def __init__(self, folder: Path | str, environ: Mapping[str, str] = os.environ) -> None:
        self.run_dir = Path(folder).expanduser().absolute()
        record = handles.read(self.run_dir)
        if record is None:
            raise UserError("run_dir", str(folder), f"is not a remote run's handle (no "
                            f"{handles.FILE}).", "pass the local run dir a remote submit "
                            "printed.")
        self.handle = record
        self._environ = environ

    def __repr__(self) -> str:
        return (f"RemoteRun({str(self.run_dir)!r}, job {self.job_id} on {self.handle.host}:"
                f"{self.handle.remote_dir})")

    @property
    def job_id(self) -> str | None:
        return self.handle.job_id

    # -- asked over the connection -------------------------------------------------------
    def _ask(self, module: str, *args: str) -> str:
        """``python -m hpc_ddp.<module> HANDLE args`` there; its standard output."""
        said = io.StringIO()
        code = handles.forward(module, [str(self.run_dir), *args], said, self._environ)
        if code != 0:
            raise UserError("run_dir", str(self.run_dir), f"{module} on {self.handle.host} "
                            f"ended with exit {code} (its message is above).",
                            f"run python -m hpc_ddp.{module} {self.run_dir} for the whole "
                            "answer.")
        return said.getvalue()

    def rows(self) -> list[dict[str, Any]]:
        """``status --json`` there: one row per run (per point of a sweep)."""
        said = json.loads(self._ask("status", "--json") or "{}")
        return list(said.get("runs") or [])

    @property
    def state(self) -> str:
        """One word (docs/api.md#states); a sweep's: RUNNING until every point ended, then
        COMPLETED when every point did, else the first other end state."""
        states = [str(r.get("state")) for r in self.rows()]
        return _one(states)

    def done(self) -> bool:
        """The job has ended (as :meth:`hpc_ddp.api.Run.done`: one that can never start has
        not, and :meth:`wait` does not wait for it)."""
        return ended(self.state)

    def stop(self, out: TextIO | None = None) -> str:
        """``status --stop`` there: a checkpoint at a step the ranks agree on; its lines
        (with the resume line)."""
        said = self._ask("status", "--stop")
        (out or sys.stdout).write(said)
        return said

    def cancel(self) -> bool:
        """``status --cancel`` there; True when something was cancelled."""
        had_ended = self.done()
        self._ask("status", "--cancel")
        return not had_ended

    def log_tail(self, lines: int = 20, rank: int = 0) -> str:
        return self._ask("logs", "--rank", str(rank), "--tail", str(lines))

    def wait(self, timeout: float | None = None, progress: bool = True,
             out: TextIO | None = None, poll_s: float = POLL_S) -> dict[str, Any]:
        """Block until the run ends, a line per change of state or step; then collect its
        results here and return the summary (RunFailed with rank 0's last lines if it did
        not complete, with the pending reason and its fix at once if it can never start,
        as a local Run's wait). ``timeout`` raises TimeoutError; the run goes on."""
        sink = out or sys.stdout
        started, shown = time.monotonic(), ""
        while True:
            try:
                rows = self.rows()
            except UserError as exc:  # a lost connection: the run goes on; ask again
                if "cannot connect" not in exc.message and "ssh failed" not in exc.message:
                    raise
                print(f"hpc_ddp: {exc.message} (asking again in {RETRY_S:.0f} s)", file=sink)
                time.sleep(RETRY_S)
                continue
            line = "; ".join(_row_line(r) for r in rows)
            if progress and line != shown:
                print(line, file=sink, flush=True)
                shown = line
            state = _one([str(r.get("state")) for r in rows])
            if all(ended(str(r.get("state")), bool(r.get("never"))) for r in rows):
                break
            if timeout is not None and time.monotonic() - started >= timeout:
                raise TimeoutError(f"{self!r} still running after {timeout:.0f}s")
            time.sleep(poll_s)
        never = [r for r in rows if r.get("never") and not ended(str(r.get("state")))]
        if not never or len(never) < len(rows):  # a job queued for good has nothing to collect
            self.collect()
        if never:  # it stays queued until cancelled (status --cancel), as a local Run says
            raise RunFailed("; ".join(f"job {r.get('job_id') or self.job_id} on "
                                      f"{self.handle.host} {r.get('pending')}" for r in never))
        if state != "COMPLETED":
            raise RunFailed(f"job {self.job_id} on {self.handle.host}: {state}\n"
                            + self.log_tail(20))
        return self.summary() or {}

    # -- results, collected here ---------------------------------------------------------
    def collect(self, checkpoint: bool = False) -> Collected:
        """The new results into the handle (hpc_ddp/remote/results.py)."""
        return collect(self.run_dir, checkpoint, self._environ)

    def summary(self) -> dict[str, Any] | None:
        """summary.json (collected first); None until the run has finished."""
        self.collect()
        data = read_json(self.run_dir / "summary.json")
        return data if isinstance(data, dict) else None

    def scalars(self, tag: str | None = None) -> dict[str, list[tuple[int, float]]]:
        """TensorBoard scalars (collected first) as {tag: [(step, value), ...]}."""
        self.collect()
        return scalars_in(self.run_dir / "tb", tag)


def _one(states: list[str]) -> str:
    if not states:
        return NOT_SUBMITTED
    if any(not ended(s) for s in states):
        return next(s for s in states if not ended(s))
    return next((s for s in states if s != "COMPLETED"), "COMPLETED")


def _row_line(row: Mapping[str, Any]) -> str:
    step = f" step {row['step']}/{row.get('total_steps') or '?'}" if row.get("step") else ""
    loss = f" loss {row['loss']:.4f}" if isinstance(row.get("loss"), (int, float)) else ""
    return f"{row.get('label', 'run')}: {row.get('state')}{step}{loss}"
