"""A failure said once: the same error from many ranks as one entry with the rank list and
hosts, different errors each once, the first to fail marked; events.jsonl keeps one line of
cause and points to a file with the lines."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpc_ddp import events
from hpc_ddp.rundir import RunDir
from hpc_ddp.watch import failures
from hpc_ddp.watch.follow import failure_report

JOB = type("Job", (), {"job_id": "7", "state": "FAILED"})()


def _failed(run: RunDir, rank: int, host: str, message: str, when: float) -> None:
    path = run.rank_error(rank)
    path.write_text(f"rank {rank} on {host}: {message}\n\nTraceback ...\n")
    os.utime(path, (when, when))


def test_a_thousand_ranks_failing_alike_are_one_entry(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    run.ranks.mkdir()
    (run.ranks / "rank0.json").write_text(json.dumps({"world_size": 1000}))
    for rank in range(1000):
        _failed(run, rank, f"n{rank // 8 + 1:03d}", f"the script exited with code 1; its last "
                f"lines:\nValueError: bad learning rate {rank}", 1000.0 + (rank + 3) % 1000)
    _failed(run, 998, "n125", "CUDA out of memory on rank 998", 999.0)
    report = failure_report(run, JOB)
    assert report.count("the script exited with code 1") == 1
    assert report.count("CUDA out of memory") == 1
    lines = report.splitlines()
    # the out-of-memory came first: its entry first, marked
    assert lines[1].startswith("first to fail: rank 998 on n125 (at ")
    assert lines[2] == "rank 998 on n125: CUDA out of memory on rank 998"
    script = next(ln for ln in lines if "exited" in ln)
    assert script.startswith("ranks 0-997,999 of 1000 on n[001-125]: the script exited")
    # the message shown is the first of them to fail's (rank 997, at time 1000.0)
    assert "bad learning rate 997" in report


def test_the_first_to_fail_among_alike(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    for rank, when in ((0, 5.0), (1, 3.0), (2, 4.0)):
        _failed(run, rank, f"node{rank}", "lost its peers", when)
    group, = failures.grouped(failures.read(run, [0, 1, 2]))
    assert group.ranks == [0, 1, 2] and group.first.rank == 1
    assert group.head(None) == "ranks 0-2 on node[0-2]: lost its peers"
    report = failures.report(run, [0, 1, 2])
    assert report[0].startswith("first to fail: rank 1 on node1 (at ")


def test_a_message_that_names_each_ranks_own_node_is_one_entry_naming_them_all(
        tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    for rank in range(4):
        _failed(run, rank, f"gpu{rank + 7}", f"no venv there on node gpu{rank + 7}.", 1.0 + rank)
    _failed(run, 4, "gpu12", "no venv there on node gpu12x.", 9.0)  # not its own name
    first, other = failures.grouped(failures.read(run, list(range(5))))
    assert first.head(None) == "ranks 0-3 on gpu[7-10]: no venv there on node gpu[7-10]."
    assert other.head(None) == "rank 4 on gpu12: no venv there on node gpu12x."


def test_an_event_keeps_one_line_and_points_to_the_rest(tmp_path: Path) -> None:
    message = "the script exited with code 1; its last lines:\n" + \
        "\n".join(f"line {i}" for i in range(30)) + "\nValueError: x"
    fields = events.cause_fields(tmp_path, message, 2, 5)
    assert fields["cause"] == "the script exited with code 1; its last lines: ... ValueError: x"
    assert (tmp_path / fields["lines"]).read_text() == message + "\n"
    assert fields["lines"] == "logs/failure-attempt2-rank5.txt"
    assert events.cause_fields(tmp_path, "one line", 0, 0) == {"cause": "one line"}
