"""One decision per failed attempt: when rank 0 (and the store it hosts) is gone, the fallback
reporter records and requeues only if nobody reported this attempt before it.

The case seen on the test cluster: rank 2's data factory failed on its node (not worth a
requeue, recorded so); srun then ended the other tasks, rank 0 and its store among them, and
a slower rank, finding the store gone, took the report over and requeued the job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_ddp import events
from hpc_ddp.bench.recording import RecordingStore, SimulatedTime, SlurmCalls
from hpc_ddp.bench.scale_world import JOB, World, _rank, address
from hpc_ddp.rank.supervise.diagnose import fallback_reporter
from hpc_ddp.rank.supervise.outcome import after_failure

SIZE = 16


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path, SIZE, (0,))


def store_gone_failure(world: World) -> tuple[str, SlurmCalls]:
    """The fallback reporter's failure handling with the store gone: its message, the
    Slurm commands it ran."""
    rank = _rank(world, fallback_reporter(SIZE // 8, 8, SIZE), RecordingStore(dead=True))
    error = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                         f"[{address(0, world.per_node)}]:29500")
    with SimulatedTime(), SlurmCalls() as slurm, pytest.raises(RuntimeError) as raised:
        after_failure(error, world.cfg, rank, world.run, {"SLURM_JOB_ID": JOB})
    return str(raised.value), slurm


def test_the_fallback_reporter_stands_down_when_the_attempt_is_reported(world: World) -> None:
    first = {"kind": "failure", "attempt": 0, "job": JOB, "rank": 2, "host": "node00000",
             "cause": "data._target_=x: raised ImportError", "step": 10}
    with (world.run.root / "events.jsonl").open("a") as f:
        f.write(json.dumps(first) + "\n")
    before = events.read(world.run.root)
    message, slurm = store_gone_failure(world)
    assert "stopped answering" in message  # its own view, in its own error
    assert events.read(world.run.root) == before  # nothing recorded a second time
    assert slurm.total == 0  # and no requeue of a failure judged final


def test_the_fallback_reporter_records_and_requeues_an_unreported_attempt(
        world: World) -> None:
    # An earlier attempt's failure (attempt 0) does not count for this one: it is attempt 0
    # of another job (a resume=true is a new job).
    earlier = {"kind": "failure", "attempt": 0, "job": "17", "rank": 3, "host": "node00000",
               "cause": "x", "step": 10}
    with (world.run.root / "events.jsonl").open("a") as f:
        f.write(json.dumps(earlier) + "\n")
    message, slurm = store_gone_failure(world)
    recorded = [e for e in events.read(world.run.root) if e.get("job") == JOB]
    assert [e["kind"] for e in recorded] == ["stop", "failure", "requeue"]
    assert slurm.calls["scontrol requeue"] == 1, slurm.calls
    assert f"Job {JOB} requeued" in message


def test_a_rank_whose_program_failed_by_itself_fails_so_when_rank_0_is_gone(
        world: World) -> None:
    """Rank 0's supervisor (and its store) gone before it decided: this rank's own final
    failure is the failure (its own message, its frames, recorded as its own), not a lost
    node to requeue from."""
    from hpc_ddp.rank.join.tracebacks import LOCAL_MARK
    from hpc_ddp.rank.supervise import generations
    from hpc_ddp.rank.supervise.outcome import after_generations

    me = fallback_reporter(SIZE // 8, 8, SIZE)
    rank = _rank(world, me, RecordingStore(dead=True))
    mine = generations.End(generations.FINAL, 1000.0, 1, "ValueError: bad value", me,
                           rank.host, trace='Traceback (most recent call last):\n  File '
                           '"nets.py", line 19, in forward\nValueError: bad value',
                           full="Traceback ...\nValueError: bad value")
    lost = generations.Decision(generations.LOST, mine, (0,))
    with SimulatedTime(), SlurmCalls() as slurm, pytest.raises(RuntimeError) as raised:
        after_generations(lost, 0, 1, world.cfg, rank, world.run, {"SLURM_JOB_ID": JOB}, mine)
    assert str(raised.value) == f"{LOCAL_MARK} ValueError: bad value"
    assert slurm.total == 0  # no requeue: a new start would fail the same way
    (failure,) = [e for e in events.read(world.run.root) if e["kind"] == events.FAILURE]
    assert (failure["rank"], failure["cause"], failure["failed_at"]) == (
        me, "ValueError: bad value", 1000.0)
