"""What the submit command says after a submission and after Ctrl-C (no run needed)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from hpc_ddp import events
from hpc_ddp.errors import UserError
from hpc_ddp.rank.services.checkpoint import LATEST
from hpc_ddp.rundir import RunDir
from hpc_ddp.submit import check_cfg_flag, next_steps
from hpc_ddp.watch.follow import stop_report, stopped_how


def test_a_slurm_submission_says_what_follows_it(tmp_path: Path) -> None:
    root = tmp_path / "runs" / "r 1"
    lines = next_steps("slurm", root, "42")
    assert lines[0] == f"  follow:      python -m hpc_ddp.status '{root}' --watch"
    assert f"hpc_ddp.Run.from_dir({str(root)!r}).wait()" in lines[1] and "squeue -j 42" in lines[1]
    assert not any("wait=true" in line for line in lines)  # re-submitting is refused: not a way
    assert next_steps("local", root, "7") == [f"  status:      python -m hpc_ddp.status '{root}'"]


@pytest.mark.parametrize("args", [["--cfg", "job"], ["model=x", "--cfg", "hydra"], ["--cfg=all"]])
def test_hydras_cfg_values_are_refused_with_the_fix(args: list[str]) -> None:
    with pytest.raises(UserError, match=r"takes no argument here.*write --cfg alone"):
        check_cfg_flag(args)
    check_cfg_flag(["--cfg", "model=resnet18"])  # an override after it is fine


def _run(tmp_path: Path, saved: int | None, logged: int | None) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    (run.root / "job.json").write_text("{}")
    if saved is not None:
        run.checkpoints.mkdir()
        (run.checkpoints / f"step_{saved:09d}.pt").write_bytes(b"")
        (run.checkpoints / LATEST).write_text(f"step_{saved:09d}.pt")
    if logged is not None:
        run.progress.write_text(json.dumps({"step": logged, "time": time.time()}))
    return run


def test_a_graceful_stop_says_nothing_is_lost(tmp_path: Path) -> None:
    run = _run(tmp_path, 831, 830)
    events.append(run.root, {"kind": "stop", "step": 831, "cause": "SIGTERM (Ctrl-C ...)"})
    said = stopped_how(run, killed=False)
    assert said == "stopped at step 831 with a checkpoint; nothing is lost."
    # follow's report of such a run: a stop, not a failure
    report = stop_report(run, type("Job", (), {"job_id": "7"})())
    assert report is not None and report.startswith("job 7 stopped at step 831 (SIGTERM")
    assert "failed" not in report and "resume=true" in report


def test_a_kill_says_how_many_steps_are_lost(tmp_path: Path) -> None:
    said = stopped_how(_run(tmp_path, 80, 97), killed=True)
    assert said == ("killed at step 97 (the last one logged) or a little later; the latest "
                    "checkpoint is step 80: 17 step(s) are lost and will be trained again.")


def test_a_kill_before_any_checkpoint(tmp_path: Path) -> None:
    said = stopped_how(_run(tmp_path, None, 30), killed=True)
    assert said.endswith("no checkpoint yet: 30 step(s) are lost and will be trained again.")


def test_a_stop_of_an_earlier_submission_is_not_this_ones(tmp_path: Path) -> None:
    run = _run(tmp_path, 40, 40)
    events.append(run.root, {"kind": "stop", "step": 40, "cause": "x", "time": 1.0})
    assert stop_report(run, type("Job", (), {"job_id": "7"})()) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_copies_of_one_interrupt_are_one_and_a_later_one_cuts_the_stop_short() -> None:
    """launch/interrupts.py's rules, fed signals by hand (the integration tests send real
    ones): the first raises, a copy within SAME_PRESS_S is dropped, a later one raises only
    where a graceful stop may be cut short, never twice."""
    from hpc_ddp.launch.interrupts import SAME_PRESS_S, Stopped, StopSignals, exit_code

    clock = _Clock()
    stops = StopSignals(clock)
    with pytest.raises(Stopped) as first:
        stops.handle(signal.SIGINT)
    assert exit_code(first.value) == 130
    clock.now += SAME_PRESS_S / 10
    stops.handle(signal.SIGINT)  # the wrapper's copy: dropped, even while a stop may be cut
    with stops.second_stops_at_once():
        stops.handle(signal.SIGINT)
        clock.now += SAME_PRESS_S
        with pytest.raises(Stopped):  # a second press, a second later
            stops.handle(signal.SIGINT)
        stops.handle(signal.SIGINT)  # a third does not interrupt the kill it asked for
    clock.now += 5
    stops.handle(signal.SIGTERM)  # outside: the stop is being acted on already
    assert stops.dropped == 4


def test_a_signal_while_a_job_goes_out_waits_until_it_is_out() -> None:
    from hpc_ddp.launch.interrupts import Stopped, StopSignals, exit_code

    stops = StopSignals(_Clock())
    went_out = []
    with pytest.raises(Stopped) as caught:
        with stops.held():
            stops.handle(signal.SIGTERM)
            went_out.append("job 7")  # the submission goes on to its end
    assert went_out == ["job 7"] and exit_code(caught.value) == 128 + signal.SIGTERM


def test_a_failure_report_leaves_out_the_logs_a_rank_never_wrote(tmp_path: Path) -> None:
    """A rank that failed before Python started (a missing venv) has an error file and no
    log: its report is the error, without `(no log at ...)` noise."""
    from hpc_ddp.watch.follow import failure_report

    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    for rank in (0, 1):
        run.rank_error(rank).write_text(f"rank {rank} on node{rank + 1}: cluster.venv=/x: no "
                                        "virtual environment there\n")
    run.rank_log(1).write_text("12:00:00 [rank 1 node2] INFO something it said\n")
    report = failure_report(run, type("Job", (), {"job_id": "7", "state": "FAILED"})())
    assert "no log at" not in report and f"last lines of {run.rank_log(0)}" not in report
    assert "ranks 0-1 on node[1-2]" in report and ": cluster.venv=/x" in report
    assert f"last lines of {run.rank_log(1)}:\n12:00:00 [rank 1 node2]" in report


def test_a_run_from_a_relative_folder_names_its_files_in_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_ddp.api import Run

    (tmp_path / "outputs" / "x").mkdir(parents=True)
    (tmp_path / "outputs" / "x" / "job.json").write_text(json.dumps(
        {"kind": "local", "job_id": "7", "controller_pid": 0}))
    monkeypatch.chdir(tmp_path)
    run = Run.from_dir("outputs/x")
    assert run.files.root == tmp_path / "outputs" / "x" and run.files.root.is_absolute()
    assert run.files.summary == tmp_path / "outputs" / "x" / "summary.json"
    assert run.run_dir.is_absolute()
