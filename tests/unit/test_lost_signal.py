"""The requeue signal again for a step Slurm's warning never reached (rank/services/lost_signal.py):
who watches, when the warning is due, what squeue's answer decides, and the command sent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.rank.contract import JOB_END_ENV, PROGRAM_CONFIG_ENV, STEP_OF_ENV
from hpc_ddp.rank.services import lost_signal
from hpc_ddp.rank.services.lost_signal import SETTLE_S, Target, Watch
from hpc_ddp.slurm.relay import RELAY

STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}


@pytest.mark.parametrize("environ, rank", [
    ({**STEP}, 1),                                   # not rank 0
    ({"SLURM_JOB_ID": "7"}, 0),                      # the batch script, no step
    ({**STEP, PROGRAM_CONFIG_ENV: "x"}, 0),          # a supervised child: its supervisor does
    ({**STEP, STEP_OF_ENV: "5"}, 0),                 # a step in someone's allocation
    ({}, 0),                                         # a local run
])
def test_only_rank_0_of_a_slurm_step_of_its_own_watches(environ: dict[str, str],
                                                         rank: int) -> None:
    assert lost_signal.target(environ, rank, "USR2", 40) is None


def test_the_target_is_the_step_and_the_bare_signal() -> None:
    assert lost_signal.target(STEP, 0, "SIGUSR2", 40) == Target("7", "0", "USR2", 40)


def test_the_end_comes_from_slurm_first_then_the_batch_script() -> None:
    assert lost_signal.expected_end({"SLURM_JOB_END_TIME": "1000", JOB_END_ENV: "2000"}) == 1000
    assert lost_signal.expected_end({JOB_END_ENV: "2000"}) == 2000
    assert lost_signal.expected_end({JOB_END_ENV: "soon"}) is None
    assert lost_signal.expected_end({}) is None


def test_due_allows_slurm_a_late_check_but_stays_ahead_of_the_limit() -> None:
    assert lost_signal.due(1000, 120) == 1000 - 120 + 15
    assert lost_signal.due(1000, 40) == 1000 - 40 + 10


def test_squeue_decides_send_now_or_wait_for_an_extended_limit() -> None:
    assert lost_signal.decide(30, 40) is None          # the limit is near: send
    assert lost_signal.decide(None, 40) is None        # squeue cannot say: the estimate stands
    assert lost_signal.decide(3600, 40) == 3600 - 40 + 10  # extended by an hour: wait


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return False


def watch_of(clock: Clock, end: float | None, lefts: list[float | None],
             signalled: bool = False, failed: str | None = None) -> tuple[Watch, list]:
    calls: list = []

    def time_left() -> float | None:
        calls.append("squeue")
        return lefts.pop(0)

    def send(argv: list[str]) -> str | None:
        calls.append(argv)
        return failed

    return Watch(Target("7", "0", "USR2", 40), lambda: signalled, time_left, send, end,
                 clock=clock, wait=clock.wait), calls


def test_a_warning_that_came_costs_no_command() -> None:
    clock = Clock(1000)
    watch, calls = watch_of(clock, end=1060, lefts=[], signalled=True)
    watch.run()
    assert calls == [] and clock.now == 1060 - 40 + 10


def test_no_warning_by_the_due_time_sends_it_to_the_step() -> None:
    clock = Clock(1000)
    watch, calls = watch_of(clock, end=1060, lefts=[25])
    watch.run()
    assert calls == ["squeue", ["scancel", "-s", "USR2", "7.0"]]
    assert watch.sent == ["scancel -s USR2 7.0"]


def test_a_step_that_began_after_the_warning_waits_for_its_peers_then_sends() -> None:
    clock = Clock(1040)  # due at 1030: already past when the step began
    watch, calls = watch_of(clock, end=1060, lefts=[15])
    watch.run()
    assert clock.waits == [SETTLE_S] and calls[-1] == ["scancel", "-s", "USR2", "7.0"]


def test_an_extended_limit_moves_the_due_time() -> None:
    clock = Clock(1000)
    watch, calls = watch_of(clock, end=1060, lefts=[3600, 30])
    watch.run()
    assert clock.waits == [30, 3600 - 40 + 10]
    assert calls == ["squeue", "squeue", ["scancel", "-s", "USR2", "7.0"]]


def test_without_an_end_in_the_environment_one_squeue_tells_it() -> None:
    clock = Clock(1000)
    watch, calls = watch_of(clock, end=None, lefts=[600, 35])
    watch.run()
    assert clock.waits == [600 - 40 + 10] and calls[-1][0] == "scancel"
    watch, calls = watch_of(Clock(1000), end=None, lefts=[None])
    watch.run()
    assert calls == ["squeue"]  # Slurm cannot say: nothing to keep


def test_a_failed_send_is_said(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(1000)
    watch, _ = watch_of(clock, end=1060, lefts=[20], failed="scancel: error: Invalid job id")
    watch.run()
    assert "sending it again failed (scancel: error: Invalid job id)" in caplog.text


def fake_scancel(tmp_path: Path, body: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "scancel").write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / "scancel").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_scancel_ended_by_the_signal_it_sent_counts_as_sent(tmp_path: Path) -> None:
    # Where Slurm signals every process of the step, scancel is one of them.
    environ = fake_scancel(tmp_path, 'echo "$@" > "$(dirname "$0")/args"; kill -USR2 $$')
    assert lost_signal.slurm_send(environ)(["scancel", "-s", "USR2", "7.0"]) is None
    assert (tmp_path / "bin" / "args").read_text() == "-s USR2 7.0\n"
    refused = fake_scancel(tmp_path / "x", 'echo "scancel: error: Kill job error" >&2; exit 1')
    assert lost_signal.slurm_send(refused)(["scancel", "-s", "USR2", "7.0"]) == (
        "scancel: error: Kill job error")


def test_the_relay_runs_a_signal_but_never_a_cancel(tmp_path: Path) -> None:
    environ = fake_scancel(tmp_path, 'echo "$@"')
    folder = tmp_path / "relay"
    folder.mkdir()
    (folder / "a.req").write_text("scancel\n-s\nUSR2\n7.0\n")
    (folder / "b.req").write_text("scancel\n7\n")
    # The relay serves while the process it is for lives: here a sleep of a second.
    subprocess.run(["sh", "-c", f'{RELAY}\nsleep 1 & hpc_ddp_slurm_relay "$1" $!', "sh",
                    str(folder)], env=environ, check=True, timeout=30)
    assert (folder / "a.rc").read_text().strip() == "0"
    assert (folder / "a.out").read_text() == "-s USR2 7.0\n"
    assert (folder / "b.rc").read_text().strip() == "2"
    assert "refused: scancel 7" in (folder / "b.err").read_text()
