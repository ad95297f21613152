"""What one rank costs stays flat from 8 to 8,192 ranks: store operations and bytes, file
operations, bytes and directory entries, Slurm commands, for start-up, a checkpoint, a resume
and failure handling. hpc_ddp's own code runs for one rank of a simulated world
(hpc_ddp/bench/scale_world.py) inside a recording store and file layer (recording.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.bench.recording import FileRecorder, RecordingStore, SimulatedTime, StoreGone
from hpc_ddp.bench.scale_world import SCENARIOS, Cost, World
from hpc_ddp.rank.supervise.diagnose import fallback_reporter

WORLDS = (8, 64, 512, 8192)
# Bytes may grow with the digits of a rank number ("rank 8191" vs "rank 7"), no more.
DIGITS_B = 64


def roles(size: int) -> dict[str, int]:
    return {"rank 0": 0, "fallback reporter": fallback_reporter(-(-size // 8), 8, size),
            "a middle rank": size // 2, "the last rank": size - 1}


@pytest.fixture(scope="module")
def costs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[tuple[str, str], Cost]]:
    root = tmp_path_factory.mktemp("worlds")
    found: dict[int, dict[tuple[str, str], Cost]] = {}
    for size in WORLDS:
        who = roles(size)
        world = World(root, size, tuple(sorted(set(who.values()))))
        found[size] = {(name, role): run(world, rank) for name, run in SCENARIOS.items()
                       for role, rank in who.items()}
    return found


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_rank_costs_the_same_in_every_world(
        costs: dict[int, dict[tuple[str, str], Cost]], scenario: str) -> None:
    smallest = costs[WORLDS[0]]
    for size in WORLDS[1:]:
        for role in roles(size):
            base, now = smallest[(scenario, role)], costs[size][(scenario, role)]
            where = f"{scenario}, {role}, world {size} vs {WORLDS[0]}"
            assert now.store_ops == base.store_ops, where
            assert now.file_ops == base.file_ops, where
            assert now.entries_listed == base.entries_listed, where
            assert now.slurm_calls == base.slurm_calls, where
            assert now.file_bytes <= base.file_bytes + DIGITS_B, where
            if (scenario, role) != ("failure: a peer hangs", "rank 0"):
                assert now.store_bytes <= base.store_bytes + DIGITS_B, where


def test_the_reporter_reads_the_survivors_once(
        costs: dict[int, dict[tuple[str, str], Cost]]) -> None:
    # The one cost that grows: the rank that names the silent ones reads the survivors' list
    # in one store get (about 5 bytes a rank), once per failure, on one rank.
    grown = [costs[s][("failure: a peer hangs", "rank 0")].store_bytes for s in WORLDS]
    assert grown[-1] > grown[0] and grown[-1] < 6 * WORLDS[-1] + grown[0]


def test_one_rank_requeues_and_records_a_failure(
        costs: dict[int, dict[tuple[str, str], Cost]]) -> None:
    for size in WORLDS:
        by_role = costs[size]
        hang = {role: by_role[("failure: a peer hangs", role)].slurm_calls for role in
                roles(size)}
        assert hang == {**{r: 0 for r in roles(size)}, "rank 0": 1}, size
        gone = {role: by_role[("failure: rank 0 and its store die", role)].slurm_calls
                for role in roles(size) if role != "rank 0"}
        assert gone == {**{r: 0 for r in gone}, "fallback reporter": 1}, size


def test_the_recording_store_counts_what_a_loop_over_ranks_would_cost(tmp_path: Path) -> None:
    # The instruments themselves: a per-rank loop (the old failure roll call) is seen.
    store = RecordingStore()
    for r in range(100):
        store.check([f"hpc_ddp/failed/{r}"])
    assert store.ops == 100 and store.calls["check"] == 100
    with FileRecorder(tmp_path) as files:
        for r in range(50):
            (tmp_path / f"rank{r}.error").is_file()
        (tmp_path / "x").write_text("hello")
        assert (tmp_path / "x").read_text() == "hello"
        list(tmp_path.iterdir())
    assert files.counts.ops["stat"] == 50 and files.counts.bytes_written == 5
    assert files.counts.bytes_read == 5 and files.counts.entries_listed == 1
    with SimulatedTime() as clock:
        import time

        start = time.monotonic()
        time.sleep(30)
        assert time.monotonic() - start == 30 and clock.slept == 30
    dead = RecordingStore(dead=True)
    with pytest.raises(StoreGone):
        dead.add("k", 1)


def test_the_benchmark_prints_every_scenario_and_the_node_lists(
        capsys: pytest.CaptureFixture[str]) -> None:
    from hpc_ddp.bench.scale import main

    assert main(["--worlds", "8,16", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SCENARIOS)
    assert "hostlist of 10,000 single nodes" in out and "SLURM_TASKS_PER_NODE" in out
    assert main(["--worlds", "1"]) == 2
