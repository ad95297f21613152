"""How a job is watched and ended, once per launch target (launch/control.py): every kind's
control has the contract, "ended" means the same to a local Run, status and a remote run
(a job that can never start ends a remote wait at once, as it ends a local one)."""

from __future__ import annotations

import inspect
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.api import Run, RunFailed
from hpc_ddp.launch import control
from hpc_ddp.launch.target import TARGETS
from hpc_ddp.remote import handle as handles
from hpc_ddp.remote.run import RemoteRun
from hpc_ddp.watch import status
from hpc_ddp.watch.follow import RunView, follow
from tests.unit.test_pending import never_starting


def test_a_remote_wait_ends_at_once_at_a_job_that_can_never_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The login node's `status --json` is the real one, run here on a Slurm run whose job
    # pends for a partition too small for it (fake Slurm commands: tests/unit/test_pending).
    run, _ = never_starting(tmp_path, monkeypatch)
    local = tmp_path / "handle"
    handles.write(local, handles.Handle("login", str(run.run_dir), "abc", ["python3"],
                                        job_id="2"))

    def there(module: str, argv: list[str], out: Any = None, environ: Any = None) -> int | None:
        if argv[0] != str(local):
            return None  # not a handle: status goes on here (the login node's own)
        assert module == "status"
        return status.main([str(run.run_dir), *argv[1:]], out=out)

    monkeypatch.setattr(handles, "forward", there)
    monkeypatch.setattr("hpc_ddp.remote.run.collect", lambda *a: pytest.fail("collected"))
    started = time.monotonic()
    with pytest.raises(RunFailed) as info:
        RemoteRun(local).wait(timeout=5, poll_s=0.01, out=io.StringIO())
    assert time.monotonic() - started < 4  # at its first look, not at the timeout
    assert str(info.value) == ("job 2 on login can never start (PartitionNodeLimit): partition "
                               "normal has 4 nodes, the job asks for 8: nodes=4")
    with pytest.raises(RunFailed, match="job 2 can never start"):  # the local form, alike
        run.wait(out=io.StringIO())


def test_ended_is_one_answer_for_every_follower() -> None:
    assert control.ended("PENDING", never=True) and not control.ended("PENDING")
    assert control.ended("NOT SUBMITTED") and control.ended("TIMEOUT")
    assert not control.ended("REQUEUED") and not control.ended("RUNNING")
    rows = [{"state": "COMPLETED"}, {"state": "PENDING", "never": True}]
    assert status.finished(rows) and not status.finished([*rows, {"state": "PENDING"}])


def _parameters(fn: Any) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_every_launch_target_has_a_job_control(kind: str) -> None:
    made = control.CONTROLS[kind]
    for name in ("state", "done", "cancel", "end_now"):
        assert _parameters(getattr(made, name)) == _parameters(
            getattr(control.JobControl, name)), (kind, name)
    for name in ("poll_s", "follower_ends_failures", "cancel_waits", "queried"):
        assert name in vars(control.JobControl).get("__annotations__", {}), name
        assert getattr(made, name) is not None, (kind, name)
    slurm = kind == "slurm"  # the ranks end a failed Slurm job; scancel returns at once
    assert (made.follower_ends_failures, made.cancel_waits, made.queried) == (
        not slurm, not slurm, slurm)


class _Handle:
    """submitit's local job, as far as a follower asks it."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished


def test_a_local_run_is_followed_and_ended_through_its_control(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stopped: list[tuple[int, float]] = []
    monkeypatch.setattr("hpc_ddp.launch.local.stop",
                        lambda pid, started, grace_s: stopped.append((pid, grace_s)))
    job = _Handle()
    run = Run(tmp_path, {"kind": "local", "job_id": "1", "controller_pid": 4321,
                         "controller_start": 0}, job)
    view = RunView(run)
    assert not view.done() and view.state == "RUNNING" and view.pending is None
    view.cancel()  # after a rank failed: the others end now, not as cancelled
    assert stopped == [(4321, 0.0)]
    (tmp_path / "summary.json").write_text(json.dumps({"global_step": 3, "world_size": 1}))
    job.finished = True
    out = io.StringIO()
    assert follow(view, run.files, out, poll_s=run.job.poll_s) == 0
    assert view.state == "COMPLETED" and run.state == "COMPLETED" and "results" in out.getvalue()
