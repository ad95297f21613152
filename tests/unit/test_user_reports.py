"""What a new user met (issue 34), each kept: a failed run's status line from its error file,
Slurm's COMPLETING shown as RUNNING, a typo in a module's name answered with the closest one,
a resumed local run's cost counting each attempt, a script that printed nothing, counts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hpc_ddp.errors import UserError
from hpc_ddp.launch.target import counted
from hpc_ddp.rank.supervise.supervisor import last_lines
from hpc_ddp.rundir import RunDir
from hpc_ddp.slurm.state import JobState
from hpc_ddp.targets import locate
from hpc_ddp.watch.failures import first_failure
from hpc_ddp.watch.runcost import local_cost


def test_a_run_that_failed_while_joining_has_a_failure_line(tmp_path: Path) -> None:
    """A refusal at join (cluster.master_interface=ib0 on a node without it) leaves error
    files but no events record: status names the first rank to fail from them."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for rank, delay in ((1, 0.0), (0, 0.05)):
        time.sleep(delay)
        (logs / f"rank{rank}.error").write_text(
            f"rank {rank} on node{rank + 1}: cluster.master_interface=ib0: no such interface "
            f"on node{rank + 1}. Fix: name one of eth0.\n\nFull traceback (hpc_ddp's frames "
            "too):\nTraceback ...")
    assert first_failure(RunDir(tmp_path)) == [{"rank": 1, "host": "node2", "cause": (
        "cluster.master_interface=ib0: no such interface on node2. Fix: name one of eth0.")}]


def test_completing_is_running() -> None:
    state = JobState.of("COMPLETING")
    assert (state.state, state.raw, state.finished) == ("RUNNING", "COMPLETING", False)


@pytest.mark.parametrize(("typed", "hint"), [
    ("tests.usercode.entriez:report", "did you mean tests.usercode.entries:report?"),
    ("testz.usercode.entries.report", "did you mean tests.usercode.entries.report?"),
    ("tests.usercode.entries:reprot", "did you mean tests.usercode.entries:report?"),
    # A mistyped module inside a package (`_target_`'s dotted form): the package imports,
    # the module is found among its modules, not its attributes.
    ("tests.usercode.prts.Mlp", "did you mean tests.usercode.parts.Mlp?"),
    ("tests.usercode.entriez.report", "did you mean tests.usercode.entries.report?"),
])
def test_a_typo_gets_the_closest_name(typed: str, hint: str) -> None:
    with pytest.raises(UserError) as raised:
        locate(typed, "entry")
    # The Fix reads as sentences: the suggestion, then the advice with a capital.
    assert f"Fix: {hint} Check the spelling; " in raised.value.message, raised.value.message


def test_a_resumed_local_runs_cost_counts_every_attempt(tmp_path: Path) -> None:
    """Two attempts of 10 s with 100 s between them: running 20 s, not 120 s; the CPU time
    of both (each rank's file keeps one record per attempt)."""
    run = RunDir(tmp_path)
    run.ranks.mkdir(parents=True)
    t0 = 1_800_000_000.0
    for rank in (0, 1):
        run.rank_usage(rank).write_text(json.dumps({"attempts": {
            "a.0": {"cpu_s": 9.0, "time": t0 + 10}, "b.0": {"cpu_s": 9.0, "time": t0 + 120}}}))
    history = [{"job_id": "1", "submitted": t0}, {"job_id": "2", "submitted": t0 + 110}]
    cost = local_cost(run, {**history[-1], "history": history}, t0 + 120)
    assert cost is not None
    assert (cost.wall_s, cost.running_s, cost.cpu_hours * 3600, cost.starts) == (
        pytest.approx(120), pytest.approx(20), pytest.approx(36), 2)


def test_a_script_that_printed_nothing_says_so() -> None:
    assert last_lines("") == " (it printed nothing)"
    assert last_lines("boom\n") == "; its last lines:\nboom\n"


def test_counts_take_their_number() -> None:
    assert [counted(1, "node"), counted(2, "task"), counted(0, "rank")] == [
        "1 node", "2 tasks", "0 ranks"]
