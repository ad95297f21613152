"""A trial whose worker is gone for good is taken over (sweep/orphans.py); one whose worker
is only away (requeued, pending, alive) is not."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_ddp.sweep import orphans


@pytest.fixture
def live_worker() -> Iterator[int]:
    """A live process whose command line is a worker's."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             "hpc_ddp.sweep.worker"])
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 10  # the exec's new command line shows a moment later
    while b"hpc_ddp.sweep.worker" not in cmdline.read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_slurm_worker_is_gone_only_when_its_array_task_left_the_queue() -> None:
    record = {"job": "41_2", "host": "node3", "pid": 7}
    assert not orphans.gone(record, {"41_0", "41_2"}, "login")  # running, or pending again
    assert orphans.gone(record, {"41_0"}, "login")  # cancelled, or its requeues spent
    assert not orphans.gone(record, None, "login")  # squeue could not say: nobody is gone


def test_a_local_worker_is_gone_when_its_process_and_its_trials_run_are(
        live_worker: int, tmp_path: Path) -> None:
    host = socket.gethostname()
    assert not orphans.gone({"job": None, "host": host, "pid": live_worker}, set(), host)
    dead = {"job": None, "host": host, "pid": _dead_pid()}
    assert orphans.gone(dead, set(), host)
    assert orphans.gone({**dead, "pid": os.getpid()}, set(), host)  # a pid reused: no worker
    assert not orphans.gone(dead, set(), "elsewhere")  # another host's: not ours to judge
    assert not orphans.gone({"trial": 3}, set(), host)  # an older sweep's file says nothing
    # Its trial's run still trains (a local run outlives a worker killed with SIGKILL).
    run = tmp_path / "trial-3"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"controller_pid": live_worker}))
    assert not orphans.gone(dead, set(), host, run)
    (run / "job.json").write_text(json.dumps({"controller_pid": _dead_pid()}))
    assert orphans.gone(dead, set(), host, run)


def test_the_orphan_is_a_running_trial_of_another_worker_that_is_gone(
        live_worker: int, tmp_path: Path) -> None:
    workers = tmp_path / "workers"
    workers.mkdir()
    host = socket.gethostname()

    def holds(index: int, trial: int | None, pid: int) -> Path:
        path = workers / f"{index}.json"
        path.write_text(json.dumps({"trial": trial, "job": None, "host": host, "pid": pid}))
        return path

    mine = holds(0, 5, _dead_pid())  # this worker's own file is never its orphan
    holds(1, 6, live_worker)  # alive: away or busy
    holds(2, 7, _dead_pid())  # gone, but trial 7 has ended (not RUNNING)
    gone = holds(3, 8, _dead_pid())
    (workers / "4.json").write_text("not json")
    env: dict[str, str] = {}
    assert orphans.orphan(tmp_path, mine, {5, 6, 8}, env) == (
        8, gone, json.loads(gone.read_text()))
    assert orphans.orphan(tmp_path, mine, {5, 6}, env) is None
    # A worker file another user wrote (a shared group folder) names no trial to take over.
    os.chown(gone, 65534, 65534)
    assert orphans.orphan(tmp_path, mine, {5, 6, 8}, env) is None
    assert orphans.read_worker_file(gone, tmp_path) is None
    assert orphans.identity({"SLURM_ARRAY_JOB_ID": "41", "SLURM_ARRAY_TASK_ID": "2"})[
        "job"] == "41_2"
    assert orphans.identity({})["job"] is None and orphans.identity({})["pid"] == os.getpid()


def test_a_trial_counts_as_stopped_only_by_a_stop_of_this_attempt(tmp_path: Path) -> None:
    # An attempt that failed after an earlier attempt's checkpointed stop failed: it is not
    # "stopped" (the worker would requeue itself for it again and again).
    from hpc_ddp import events
    from hpc_ddp.sweep.worker import _stopped

    events.append(tmp_path, {"kind": events.STOP, "time": 100.0, "step": 120})
    assert _stopped(tmp_path, since=50.0) and not _stopped(tmp_path, since=150.0)
    events.append(tmp_path, {"kind": "failure", "time": 160.0})
    assert not _stopped(tmp_path, since=50.0)
