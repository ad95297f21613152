"""Stop signals: durations from squeue, what a stop was, the restart history."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp import events
from hpc_ddp.rank.contract import EARLY_STOP_ENV, TASK_ENV, WARM_ENV
from hpc_ddp.rank.services.stopping import (
    NONE,
    REQUEUE,
    TERM,
    StopRequest,
    cause_of,
    parse_duration,
    requeue_signal_said,
)
from tests.conftest import REPO
from tests.usercode.slow_exit import HandlesThenEnds


@pytest.mark.parametrize("text, seconds", [("59", 59), ("1:30", 90), ("2:00:05", 7205),
                                           ("1-00:00:10", 86410), ("UNLIMITED", None),
                                           ("INVALID", None), ("", None)])
def test_parse_duration(text: str, seconds: float | None) -> None:
    assert parse_duration(text) == seconds


def test_cause_of() -> None:
    assert cause_of(REQUEUE, 100, 120) == "time limit"
    assert cause_of(REQUEUE, 3000, 120) == "preemption or a signal sent by hand"
    assert cause_of(REQUEUE, None, 120).startswith("preemption")
    assert cause_of(TERM, 10, 120).startswith("SIGTERM")


@pytest.mark.parametrize("left, said", [
    # Issue 46: a script preempted with 59 of its 60 minutes left was told "sent 120s
    # before the time limit". The built-in trainer's rule (cause_of) decides for it too.
    (3540.0, "SIGUSR2, the requeue signal (sent at a preemption or by hand, 59m00s before "
             "the time limit)"),
    (None, "SIGUSR2, the requeue signal (sent at a preemption or by hand, not for the time "
           "limit)"),
    (100.0, "SIGUSR2, the requeue signal (sent 120s before the time limit)"),
    (200.0, "SIGUSR2, the requeue signal (sent 120s before the time limit)"),  # 60 s early
])
def test_an_unhandled_requeue_signal_says_why_it_came(left: float | None, said: str) -> None:
    assert requeue_signal_said("SIGUSR2", left, 120) == said
    time_limit = cause_of(REQUEUE, left, 120) == "time limit"
    assert ("preemption" not in said) == time_limit


def test_handlers_only_set_the_flag() -> None:
    saved = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)
    try:
        stop = StopRequest()
        stop.install("USR2")
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.code == TERM
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.code == REQUEUE and [n for n, _ in stop.received] == ["SIGTERM", "SIGUSR2"]
    finally:
        signal.signal(signal.SIGUSR2, saved[0])
        signal.signal(signal.SIGTERM, saved[1])


def test_history(tmp_path: Path) -> None:
    events.append(tmp_path, {"kind": "stop", "attempt": 0, "cause": "time limit"})
    events.append(tmp_path, {"kind": "requeue", "attempt": 0, "cause": "time limit"})
    events.append(tmp_path, {"kind": "failure", "attempt": 1, "cause": "rank 1 died"})
    events.append(tmp_path, {"kind": "failure", "attempt": 1, "cause": "echo: peer lost"})
    with open(tmp_path / events.FILE, "a") as handle:
        handle.write('{"kind": "requ')  # a line cut by a crash
    history = events.read(tmp_path)
    assert len(history) == 4 and events.requeues_by_us(history) == 1
    assert events.last_reason(history, 0) == "time limit"
    assert events.last_reason(history, 1) == "rank 1 died"
    assert events.last_reason(history, 2) is None


def rq(job: str, step: int | None, attempt: int = 0) -> dict:  # type: ignore[type-arg]
    return {"kind": "requeue", "job": job, "step": step, "attempt": attempt, "cause": "x"}


@pytest.mark.parametrize("history, job, spent", [
    # a long run cut into time-limit slices: every requeue after new checkpoints
    ([rq("7", 100), rq("7", 200), rq("7", 300), rq("7", 400)], "7", 0),
    # a crash loop at one checkpoint: each requeue without progress adds one
    ([rq("7", 100), rq("7", 100), rq("7", 100)], "7", 2),
    # progress starts the count again
    ([rq("7", 100), rq("7", 100), rq("7", 250), rq("7", 250)], "7", 1),
    # no checkpoint yet: no progress either
    ([rq("7", None), rq("7", None)], "7", 2),
    # resume=true is a new job: the earlier job's requeues are not this job's budget
    ([rq("6", 100), rq("6", 100), rq("6", 100)], "7", 0),
    ([], "7", 0),
])
def test_max_restarts_counts_requeues_without_progress_per_job(
        history: list, job: str, spent: int) -> None:  # type: ignore[type-arg]
    assert events.restarts_spent(history, job) == spent


def test_an_earlier_jobs_reasons_are_not_reported_for_a_new_one() -> None:
    history = [{**rq("6", 100, attempt=0), "cause": "old job's time limit"}]
    assert events.last_reason(history, 0, job="7") is None
    assert events.last_reason(history, 0, job="6") == "old job's time limit"


def test_submitits_sigcont_warning_is_silenced(caplog: pytest.LogCaptureFixture) -> None:
    """Slurm's SIGCONT at a requeue or cancel: submitit's handler logged "Bypassing signal
    SIGCONT" as a warning on every rank; after install it is the default action (a no-op
    for a running process), and a handler of the user's own is kept."""
    from submitit.core.job_environment import SignalHandler

    saved = [signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGCONT)]
    try:
        bypass = SignalHandler.__new__(SignalHandler)
        bypass._logger = __import__("logging").getLogger("submitit")
        signal.signal(signal.SIGCONT, bypass.bypass)
        os.kill(os.getpid(), signal.SIGCONT)
        assert "Bypassing signal SIGCONT" in caplog.text  # what ranks logged before
        caplog.clear()
        StopRequest().install("USR2")
        assert signal.getsignal(signal.SIGCONT) == signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGCONT)
        assert "Bypassing" not in caplog.text

        def mine(signum: int, frame: object) -> None:
            pass

        signal.signal(signal.SIGCONT, mine)
        StopRequest().install("USR2")
        assert signal.getsignal(signal.SIGCONT) is mine
    finally:
        for s, h in zip((signal.SIGUSR2, signal.SIGTERM, signal.SIGCONT), saved, strict=True):
            signal.signal(s, h)


@pytest.mark.parametrize("given, code", [({}, NONE), ({EARLY_STOP_ENV: str(REQUEUE)}, REQUEUE)])
def test_a_rank_takes_the_signals_first_and_a_child_its_supervisors_stop(
        given: dict[str, str], code: int) -> None:
    """The requeue signal may come seconds after the start: the rank's handler is the first
    thing it installs, and a supervised child starts with what its supervisor was told."""
    from hpc_ddp.config.compose import compose
    from hpc_ddp.rank.main.task import signals_first

    saved = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)
    try:
        stop = signals_first(compose([]), given)
        assert stop.code == code
        os.kill(os.getpid(), signal.SIGUSR2)  # ours now, not submitit's (or the default's)
        assert stop.code == REQUEUE
    finally:
        signal.signal(signal.SIGUSR2, saved[0])
        signal.signal(signal.SIGTERM, saved[1])


def test_a_signal_before_the_stop_request_is_acted_on_when_it_is_installed() -> None:
    """submitit's task handlers are replaced (rank/main/submitted.py): a requeue signal that
    comes while the program starts is recorded, not taken as a time-out, and the stop
    request installed later acts on it."""
    import os
    import signal as signals

    from hpc_ddp.rank.main.submitted import held_until_ours
    from hpc_ddp.rank.services import early_signals, stopping

    class Env:
        @staticmethod
        def _usr_sig() -> int:
            return int(signals.SIGUSR2)

    held_until_ours(Env(), None, None)
    os.kill(os.getpid(), signals.SIGUSR2)
    assert early_signals.RECORDED == [signals.SIGUSR2]
    stop = stopping.StopRequest()
    stop.install("USR2")
    assert stop.code == stopping.REQUEUE and [n for n, _ in stop.received] == ["SIGUSR2"]
    assert early_signals.RECORDED == []  # acted on once
    os.kill(os.getpid(), signals.SIGTERM)  # from now on the request's own handlers
    assert [n for n, _ in stop.received] == ["SIGUSR2", "SIGTERM"]
    assert not early_signals.RECORDED


def test_a_task_holds_the_stop_signals_from_its_first_line_and_its_request_takes_them() -> None:
    """A task entry holds the requeue signal its job names and SIGTERM (early_signals.py):
    one pending since the process started (blocked by its parent) or sent before the stop
    request exists is recorded, not fatal; a request for another requeue signal takes over
    SIGTERM and gives the held one its default action back."""
    import os
    import signal as signals
    import threading

    from hpc_ddp.rank.services import early_signals, stopping

    assert early_signals.held_signals({}) == sorted([signals.SIGUSR2, signals.SIGTERM])
    assert early_signals.held_signals({"SUBMITIT_PREEMPT_SIGNAL": "usr1"}) == sorted(
        [signals.SIGUSR1, signals.SIGTERM])
    assert early_signals.held_signals({"SUBMITIT_PREEMPT_SIGNAL": "NOPE"}) == sorted(
        [signals.SIGUSR2, signals.SIGTERM])
    signals.pthread_sigmask(signals.SIG_BLOCK, {signals.SIGUSR1})
    # Pending on this thread (a warm fork has one thread, and starts with it blocked): sent
    # to the process, another thread of this one (pytest-xdist's) would take it.
    signals.pthread_kill(threading.get_ident(), signals.SIGUSR1)
    assert early_signals.hold({"SUBMITIT_PREEMPT_SIGNAL": "USR1"}) == sorted(
        [signals.SIGUSR1, signals.SIGTERM])
    assert early_signals.RECORDED == [signals.SIGUSR1]  # delivered once held
    os.kill(os.getpid(), signals.SIGTERM)
    stop = stopping.StopRequest()
    stop.install("USR2")  # the config names another signal than the job's
    assert stop.code == stopping.TERM and [n for n, _ in stop.received] == ["SIGTERM"]
    assert signals.getsignal(signals.SIGUSR1) is signals.SIG_DFL
    assert early_signals.HELD == [signals.SIGTERM] and early_signals.RECORDED == []
    assert stopping.signal_of(stopping.TERM, "USR2") == signals.SIGTERM
    assert stopping.signal_of(stopping.REQUEUE, "SIGUSR1") == signals.SIGUSR1


def test_a_finished_task_is_not_ended_by_a_stop_signal_while_python_exits(
        tmp_path: Path) -> None:
    """Slurm's warning and SIGTERM reach every process of a step at any moment: one that comes
    while a task whose program has ended exits (Python's exit sets its handlers back to the
    default action first) must not make it a task killed by that signal (a FAILED job)."""
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True, mode=0o750)
    run.chmod(0o750)
    done, task = tmp_path / "done", run / "submitit" / "step-exit.pkl"
    task.write_bytes(pickle.dumps(HandlesThenEnds(str(done))))
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp.rank.main.step"], cwd=REPO,
                            env={**os.environ, TASK_ENV: str(task), WARM_ENV: "0"})
    deadline = time.monotonic() + 60
    while not done.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
        time.sleep(0.01)
    sent = 0
    while proc.poll() is None:  # through its whole exit: every 5 ms, either signal
        try:
            os.kill(proc.pid, (signal.SIGUSR2, signal.SIGTERM)[sent % 2])
        except ProcessLookupError:
            break
        sent += 1
        time.sleep(0.005)
    assert proc.wait(timeout=60) == 0
    assert sent > 20  # the signals came while it exited (its objects take ~1 s to free)


def test_task_entries_hold_the_stop_signals_before_importing_the_rest() -> None:
    """The task entries (rank/main/submitted.py, step.py) import only what holding the stop
    signals needs before main holds them: every other module is time in which Slurm's warning
    would end a starting task (seen in CI: a requeued start's task 0.3 s after its launch)."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, hpc_ddp.rank.main.submitted, hpc_ddp.rank.main.step; "
         "print(' '.join(m for m in sys.modules if m.startswith('hpc_ddp')))"],
        capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert set(loaded) == {"hpc_ddp", "hpc_ddp.version", "hpc_ddp.rank", "hpc_ddp.rank.main",
                           "hpc_ddp.rank.services", "hpc_ddp.rank.services.early_signals",
                           "hpc_ddp.rank.main.submitted", "hpc_ddp.rank.main.step"}, loaded
