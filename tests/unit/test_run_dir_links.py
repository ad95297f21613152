"""A second user who could plant files in a run dir before it is used: no append or write of
a rank, its supervisor or the launcher goes through a symbolic link planted at a run-dir
file's name, or into someone else's file there, and a planted rank log stops every rank at
once (docs/security.md). Real files on disk; the foreign owner needs root."""

from __future__ import annotations

import faulthandler
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp import events
from hpc_ddp.config.compose import compose
from hpc_ddp.errors import UserError
from hpc_ddp.inputs.run_dir import check_run_dir, write_run_config
from hpc_ddp.owned import Untrusted, open_append
from hpc_ddp.rank.services import stacks
from hpc_ddp.rundir import RunDir

ROOT = os.geteuid() == 0
FOREIGN = 12345


def _victim(tmp_path: Path) -> Path:
    """A file of ours elsewhere that a planted link points to."""
    target = tmp_path / "victim.txt"
    target.write_text("mine\n")
    return target


def _run_dir(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True, mode=0o750)
    run.root.chmod(0o750)
    return run


def test_an_event_is_not_appended_through_a_planted_link(tmp_path: Path) -> None:
    run, target = _run_dir(tmp_path), _victim(tmp_path)
    (run.root / events.FILE).symlink_to(target)
    with pytest.raises(Untrusted, match=r"events\.jsonl is a symbolic link: .* Fix: remove"):
        events.append(run.root, {"kind": "failure", "cause": "boom"})
    assert target.read_text() == "mine\n"


def test_stacks_are_not_dumped_through_a_planted_link(tmp_path: Path) -> None:
    run, target = _run_dir(tmp_path), _victim(tmp_path)
    (run.logs / "rank0.stacks").symlink_to(target)
    try:
        with pytest.raises(Untrusted, match=r"rank0\.stacks is a symbolic link"):
            stacks.enable(run.logs / "rank0.stacks", signal.SIGUSR1)
    finally:
        faulthandler.unregister(signal.SIGUSR1)  # were it registered after all
    assert target.read_text() == "mine\n"


def test_a_planted_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    os.mkfifo(run.logs / "rank0.stacks")
    reader = os.open(run.logs / "rank0.stacks", os.O_RDONLY | os.O_NONBLOCK)
    try:  # with a reader the open succeeds: the descriptor's type refuses it
        with pytest.raises(Untrusted, match="not a regular file"):
            stacks.enable(run.logs / "rank0.stacks", signal.SIGUSR1)
    finally:
        os.close(reader)
        faulthandler.unregister(signal.SIGUSR1)
    # With no reader a blocking open would wait for one forever: refused at once instead.
    os.mkfifo(run.root / events.FILE)
    done = subprocess.run([sys.executable, "-c", "import sys, pathlib; from hpc_ddp import "
                           "events; events.append(pathlib.Path(sys.argv[1]), {})",
                           str(run.root)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 1 and "events.jsonl is not a regular file" in done.stderr


@pytest.mark.skipif(not ROOT, reason="making a second user's file needs root")
def test_a_file_of_someone_else_is_not_appended_to(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    for path in (run.root / events.FILE, run.logs / "rank0.stacks", run.rank_log(0)):
        path.write_text("theirs\n")
        os.chown(path, FOREIGN, FOREIGN)
    with pytest.raises(Untrusted, match=rf"events\.jsonl is not yours: .*uid {FOREIGN}"):
        events.append(run.root, {"kind": "stop"})
    with pytest.raises(Untrusted, match=r"rank0\.stacks is not yours"):
        stacks.enable(run.logs / "rank0.stacks", signal.SIGUSR1)
    faulthandler.unregister(signal.SIGUSR1)
    from hpc_ddp.rank.join import ranklog

    with pytest.raises(UserError, match=r"rank0\.log is not yours"):
        ranklog.setup(run.rank_log(0), 0, "node1", echo=False)
    for path in (run.root / events.FILE, run.logs / "rank0.stacks", run.rank_log(0)):
        assert path.read_text() == "theirs\n"


def test_an_own_file_is_appended_to_and_a_new_one_made_with_the_umask(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    events.append(run.root, {"kind": "stop"})
    events.append(run.root, {"kind": "requeue"})
    assert [e["kind"] for e in events.read(run.root)] == ["stop", "requeue"]
    previous = os.umask(0o077)
    try:
        os.close(open_append(run.logs / "rank3.log"))
    finally:
        os.umask(previous)
    assert (run.logs / "rank3.log").stat().st_mode & 0o777 == 0o600


def test_replaced_files_replace_a_planted_link_and_leave_its_target(tmp_path: Path) -> None:
    from hpc_ddp.rank.join.joined import record_error

    run, target = _run_dir(tmp_path), _victim(tmp_path)
    lines = run.logs / "failure-attempt0-rank1.txt"
    lines.symlink_to(target)
    run.rank_error(1).symlink_to(target)
    assert events.cause_fields(run.root, "one\ntwo", 0, 1)["lines"] == f"logs/{lines.name}"
    record_error(run, 1, "node2", "rank 1 failed", None)
    assert target.read_text() == "mine\n"
    assert not lines.is_symlink() and lines.read_text() == "one\ntwo\n"
    assert not run.rank_error(1).is_symlink() and "rank 1 failed" in run.rank_error(1).read_text()


# Before any rank starts: the run dir's check, at submission and on every sbatch task.

def _resumable(tmp_path: Path) -> tuple[RunDir, list[str]]:
    run = _run_dir(tmp_path)
    first = ["cluster=local", "nodes=1", "cluster.tasks_per_node=2", "trainer.max_steps=4",
             f"run_dir={run.root}"]
    write_run_config(run, compose(first), first)
    for rank in (0, 1):
        run.rank_log(rank).write_text("")
    return run, first


@pytest.mark.parametrize("planted", ["logs/rank1.log", "logs/rank1.stacks", "logs/rank0.error",
                                     "events.jsonl", "logs"])
def test_the_run_dir_check_refuses_a_planted_link_before_any_rank_starts(
        tmp_path: Path, planted: str) -> None:
    from hpc_ddp.train import check_run_dir as check_on_every_task

    run, first = _resumable(tmp_path)
    if planted == "logs":  # the whole folder, pointing to one of ours elsewhere
        target = tmp_path / "elsewhere"
        os.rename(run.logs, target)
    else:
        target = _victim(tmp_path)
        (run.root / planted).unlink(missing_ok=True)
    (run.root / planted).symlink_to(target)
    cfg = compose([*first, "resume=true"])
    # the task of the rank whose file it is (a task checks its own: nothing per other rank)
    rank = int(planted.split("rank")[1].split(".")[0]) if "rank" in planted else 1
    for check in (lambda: check_run_dir(cfg),  # submission (the local launcher's too)
                  lambda: check_on_every_task(cfg, run.root, 0, rank),  # a task, resuming
                  lambda: check_on_every_task(cfg, run.root, 1, rank)):  # a requeued task
        with pytest.raises(UserError) as raised:
            check()
        assert f"{run.root / planted} is a symbolic link" in raised.value.message
    if planted != "logs":
        assert target.read_text() == "mine\n"


def test_a_clean_run_dir_passes_the_check(tmp_path: Path) -> None:
    run, first = _resumable(tmp_path)
    (run.logs / "rank0.stacks").write_text("")
    events.append(run.root, {"kind": "stop"})
    (run.logs / "notes.link").symlink_to(tmp_path)  # not a file any rank writes
    assert check_run_dir(compose([*first, "resume=true"])) == run


@pytest.mark.skipif(not ROOT, reason="making a second user's folder needs root")
@pytest.mark.parametrize("planted", ["logs", "events.jsonl"])
def test_the_run_dir_check_refuses_a_logs_folder_or_events_of_someone_else(
        tmp_path: Path, planted: str) -> None:
    run, first = _resumable(tmp_path)
    (run.root / events.FILE).write_text("")
    os.chown(run.root / planted, FOREIGN, FOREIGN)
    with pytest.raises(UserError, match=rf"{planted} is not yours: the \w+ belongs to uid "
                                        f"{FOREIGN}"):
        check_run_dir(compose([*first, "resume=true"]))


def test_a_resume_with_a_planted_rank_log_ends_at_submission_in_one_line(
        tmp_path: Path) -> None:
    from hpc_ddp.submit import main as submit_main

    run, _ = _resumable(tmp_path)
    target = _victim(tmp_path)
    run.rank_log(1).unlink()
    run.rank_log(1).symlink_to(target)
    err, started = io.StringIO(), time.monotonic()
    sys_err, sys.stderr = sys.stderr, err
    try:
        code = submit_main([f"run_dir={run.root}", "resume=true"], out=io.StringIO())
    finally:
        sys.stderr = sys_err
    assert code == 2 and time.monotonic() - started < 20
    said = err.getvalue().strip().splitlines()
    assert len(said) == 1 and f"{run.rank_log(1)} is a symbolic link" in said[0]
    assert not run.rendezvous.exists()  # no rank started
    assert target.read_text() == "mine\n"


# A start no submission checked first (a requeue): rank 0's refusal reaches the others.

def test_rank_0_refusing_its_log_stops_the_other_ranks_at_once(tmp_path: Path) -> None:
    from hpc_ddp.rank.contract import CAPTURED_ENV
    from hpc_ddp.rank.join import rendezvous
    from hpc_ddp.rank.join.checkin import RendezvousError
    from hpc_ddp.rank.join.distenv import detect
    from hpc_ddp.rank.join.joined import joined

    run, target = _run_dir(tmp_path), _victim(tmp_path)
    run.rank_log(0).symlink_to(target)
    cfg = compose(["cluster=local", f"run_dir={run.root}", "trainer.rendezvous_timeout_s=5"])
    ranks = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
              "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "42",
              CAPTURED_ENV: str(run.rank_log(r))} for r in (0, 1)]  # no capture of pytest's
    with pytest.raises(UserError, match=r"rank0\.log is a symbolic link"):
        with joined(cfg, run, ranks[0], group=False):
            pass
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=r"rank 0 refused to start: .*rank0\.log is a "
                                              "symbolic link"):
        rendezvous.connect(detect(ranks[1]), run.rendezvous, "node2", 60.0, 60.0, plain=True)
    assert time.monotonic() - started < 5
    assert target.read_text() == "mine\n"


def test_a_task_checks_its_own_ranks_files_only(tmp_path: Path) -> None:
    """A task's cost stays the same at any world size: it looks at its own rank's names, not
    at a listing of every rank's (submission lists them once, for all)."""
    from hpc_ddp.train import check_run_dir as check_on_every_task

    run, first = _resumable(tmp_path)
    run.rank_log(1).unlink()
    run.rank_log(1).symlink_to(_victim(tmp_path))
    cfg = compose([*first, "resume=true"])
    check_on_every_task(cfg, run.root, 1, 0)  # rank 0's task: its own files are fine
    with pytest.raises(UserError, match="rank1.log is a symbolic link"):
        check_on_every_task(cfg, run.root, 1, 1)
    with pytest.raises(UserError, match="rank1.log is a symbolic link"):
        check_run_dir(cfg)
