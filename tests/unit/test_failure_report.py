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
