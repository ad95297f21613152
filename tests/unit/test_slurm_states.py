"""Slurm states: parsed from recorded squeue/sacct output, normalised to one word, and asked
for in one squeue and at most one sacct call whatever the number of jobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_ddp.slurm.state import (
    JobState,
    normalise,
    parse_sacct,
    parse_squeue,
    query,
    query_many,
)
from tests.unit.slurm_records import (
    SACCT_2205,
    SACCT_2205_CANCELLED,
    SQUEUE_2205,
    calls,
    fake_slurm,
)


@pytest.mark.parametrize("raw, word", [
    ("CANCELLED by 0", "CANCELLED"), ("CANCELLED by 1000", "CANCELLED"),
    ("CANCELLED+", "CANCELLED"),  # a fixed-width sacct column cut it
    ("completed", "COMPLETED"), ("RUNNING", "RUNNING"), ("", ""), ("  ", ""),
])
def test_states_are_one_word(raw: str, word: str) -> None:
    assert normalise(raw) == word
    state = JobState.of(raw, "0:0", "None")
    assert state.state == word and state.raw == raw.strip() and state.reason == ""


def test_squeue_lines_give_state_reason_and_partition() -> None:
    found = parse_squeue(SQUEUE_2205)
    assert found["2"] == JobState("PENDING", "", "PartitionNodeLimit", "PENDING", "normal")
    assert {found[f"1_{t}"].reason for t in range(10)} == {"JobHeldUser"}
    assert found["4_2"].state == "RUNNING" and found["4_2"].reason == ""
    # A reason holding commas and colons stays whole.
    odd = parse_squeue("7|PENDING|ReqNodeNotAvail, UnavailableNodes:node[3-4]|gpu,cpu")
    assert odd["7"].reason == "ReqNodeNotAvail, UnavailableNodes:node[3-4]"
    assert odd["7"].partition == "gpu,cpu"


def test_sacct_ranges_stand_for_every_task_that_never_started() -> None:
    pending = parse_sacct(SACCT_2205)
    assert all(pending[f"1_{t}"].state == "PENDING" for t in range(10))
    assert "4_2" not in pending  # running, not yet in accounting: squeue answers for it
    cancelled = parse_sacct(SACCT_2205_CANCELLED)
    assert cancelled["2"].state == "CANCELLED" and cancelled["2"].raw == "CANCELLED by 0"
    assert cancelled["2"].finished and cancelled["1_3"].finished
    # Other shapes of a range: a throttle (%2), several spans, a step (from --array=1-9:4).
    other = parse_sacct("5_[2-3%2]|PENDING|0:0|JobArrayTaskLimit\n"
                        "6_[0,3-4]|CANCELLED by 1000|0:0|None\n7_[1-9:4]|PENDING|0:0|None")
    assert set(other) == {"5_2", "5_3", "6_0", "6_3", "6_4", "7_1", "7_5", "7_9"}


def test_a_tasks_own_record_wins_over_its_range() -> None:
    text = "1_3|RUNNING|0:0|None\n1_[0-9]|PENDING|0:0|JobHeldUser"
    assert parse_sacct(text)["1_3"].state == "RUNNING"
    assert parse_sacct(text)["1_4"].state == "PENDING"


def test_an_empty_state_is_not_an_end() -> None:
    assert not JobState("").finished and not JobState("REQUEUED").finished
    assert JobState("CANCELLED by 1000").finished and JobState("TIMEOUT").finished


def test_a_whole_sweep_costs_one_squeue_and_one_sacct(tmp_path: Path) -> None:
    # 1,000 points in 100 arrays of 10; squeue lists the queued ones, sacct the ended ones.
    squeue = "".join(f"{a}_{t}|PENDING|JobHeldUser|normal\n" for a in range(100, 150)
                     for t in range(10))
    sacct = "".join(f"{a}_[0-9]|CANCELLED by 0|0:0|None\n" for a in range(150, 200))
    folder, log = fake_slurm(tmp_path / "bin", {"squeue": squeue, "sacct": sacct})
    ids = [f"{a}_{t}" for a in range(100, 200) for t in range(10)]
    found = query_many(ids, {"PATH": str(folder)})
    assert len(found) == 1000
    assert {found[i].state for i in ids[:500]} == {"PENDING"}
    assert {found[i].state for i in ids[500:]} == {"CANCELLED"}
    made = calls(log)
    assert len(made) == 2, made
    squeue_call, sacct_call = made
    assert squeue_call.startswith("squeue") and sacct_call.startswith("sacct")
    # Asked by array id, not by task: 100 ids on the line, not 1,000; sacct only the ended.
    asked = squeue_call.split(" -j ")[1].split()[0].split(",")
    assert asked == [str(a) for a in range(100, 200)]
    assert sacct_call.split(" -j ")[1].split()[0].split(",") == [str(a) for a in range(150, 200)]


def test_one_job_in_the_queue_costs_one_call(tmp_path: Path) -> None:
    folder, log = fake_slurm(tmp_path / "bin", {"squeue": SQUEUE_2205, "sacct": SACCT_2205})
    state = query("2", {"PATH": str(folder)})
    assert state is not None and state.reason == "PartitionNodeLimit"
    assert [c.split()[0] for c in calls(log)] == ["squeue"]
    assert " -u " not in calls(log)[0]  # one id: squeue loads that job only


def test_an_ended_job_is_asked_of_accounting(tmp_path: Path) -> None:
    folder, log = fake_slurm(tmp_path / "bin", {"squeue": "", "sacct": SACCT_2205_CANCELLED},
                             rc={"squeue": 1})  # squeue -j <gone>: "Invalid job id specified"
    state = query("2", {"PATH": str(folder)})
    assert state is not None and state.state == "CANCELLED" and state.raw == "CANCELLED by 0"
    assert [c.split()[0] for c in calls(log)] == ["squeue", "sacct"]


def test_no_slurm_at_all_is_unknown(tmp_path: Path) -> None:
    assert query("2", {"PATH": str(tmp_path / "empty")}) is None
    assert query_many([], {"PATH": str(tmp_path)}) == {}


def test_status_rows_of_a_sweep_cost_two_calls(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_ddp.watch.status import rows_of

    squeue = "".join(f"9_{t}|PENDING|JobHeldUser|normal\n" for t in range(10))
    folder, log = fake_slurm(tmp_path / "bin", {"squeue": squeue, "sacct": "", "sinfo": ""})
    monkeypatch.setenv("PATH", str(folder))
    runs = []
    for t in range(10):
        run = tmp_path / f"{t:03d}"
        run.mkdir()
        (run / "job.json").write_text(json.dumps({"kind": "slurm", "job_id": f"9_{t}"}))
        runs.append((f"p{t}", run))
    rows = rows_of(runs)
    assert [r["state"] for r in rows] == ["PENDING"] * 10
    assert {r["reason"] for r in rows} == {"JobHeldUser"}
    assert all("held" in r["pending"] and not r["never"] for r in rows)
    # squeue for the live states, one sacct for what they cost so far; no sinfo
    assert [c.split()[0] for c in calls(log)] == ["squeue", "sacct"]
