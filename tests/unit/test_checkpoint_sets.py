"""Checkpoint sets: written in the background, made the latest only when whole, loaded as data
from files only this user can change."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpc_ddp.rank.services import checkpoint, rng, trusted
from hpc_ddp.rank.services.checkpoint import CheckpointError
from hpc_ddp.rank.services.ckpt_writer import CheckpointWriter, snapshot
from hpc_ddp.rank.services.trusted import UntrustedCheckpoint


def writers(folder: Path, world: int, **kwargs: Any) -> list[CheckpointWriter]:
    store = dist.HashStore()  # one job's store, shared by the simulated ranks' threads
    return [CheckpointWriter(folder, r, world, keep=2, store=store, **kwargs)
            for r in range(world)]


def test_latest_moves_only_once_every_rank_wrote_its_part(tmp_path: Path) -> None:
    ranks = writers(tmp_path, 3)
    ranks[0].save(10, {"w": torch.ones(4)}, {"step": 10})
    deadline = time.monotonic() + 30
    while not (tmp_path / checkpoint.name_for(10)).exists():  # rank 0's own file is written
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    assert checkpoint.latest_path(tmp_path) is None and ranks[0].busy  # 2 parts missing
    ranks[1].save(10, None, {"step": 10})
    ranks[2].save(10, None, {"step": 10})
    for writer in ranks:
        writer.wait()
    assert checkpoint.latest_step(tmp_path) == 10
    assert [checkpoint.load_streams(tmp_path, r, 10) for r in range(3)] == [{"step": 10}] * 3


def test_a_rank_that_never_writes_its_part_leaves_the_previous_latest(tmp_path: Path) -> None:
    ranks = writers(tmp_path, 2, timeout_s=30)  # step 10's set is whole, however slow
    for writer in ranks:
        writer.save(10, {"step": 10} if writer.rank == 0 else None, {"step": 10})
    for writer in ranks:
        writer.wait()
    ranks[0].timeout_s = 0.5  # read when it waits for the others' parts
    ranks[0].save(20, {"step": 20}, {"step": 20})  # rank 1 never saves step 20
    with pytest.raises(CheckpointError, match=r"only 1 of 2 ranks .* step 20 .*missing: rank 1\)"
                                              r".* not made the latest .*step_000000010.pt "
                                              r"still is"):
        ranks[0].wait()
    assert checkpoint.latest_step(tmp_path) == 10


def test_the_copy_is_taken_at_the_step_and_one_write_runs_at_a_time(tmp_path: Path) -> None:
    (writer,) = writers(tmp_path, 1)
    weights = torch.zeros(1000)
    tied = {"a": weights, "b": weights, "n": [1, (2, "x")], "none": None}
    writer.save(1, {"model": tied}, {})
    weights += 1  # the next optimizer step changes the weights in place at once
    writer.save(2, {"model": tied}, {})  # waits for step 1's set first
    assert checkpoint.latest_step(tmp_path) in (1, 2)
    writer.wait()
    one = trusted.load(tmp_path / checkpoint.name_for(1), tmp_path)["model"]
    assert torch.equal(one["a"], torch.zeros(1000)) and one["n"] == [1, (2, "x")]
    assert one["a"].data_ptr() == one["b"].data_ptr()  # tied weights stay tied
    two = checkpoint.load_latest(tmp_path)
    assert two is not None and torch.equal(two["model"]["a"], torch.ones(1000))
    copied = snapshot({"t": weights})
    assert copied["t"] is not weights and torch.equal(copied["t"], weights)


def test_random_streams_come_back_through_a_data_only_file(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    rng.seed_all(3)
    saved = rng.capture({"g": gen})
    checkpoint.write_streams(tmp_path, 4, 7, saved)
    first = (np.random.rand(), torch.rand(2), torch.rand(1, generator=gen))
    rng.seed_all(99)
    loaded = checkpoint.load_streams(tmp_path, 4, 7)
    assert loaded is not None
    rng.restore(loaded, {"g": gen})
    again = (np.random.rand(), torch.rand(2), torch.rand(1, generator=gen))
    assert first[0] == again[0] and torch.equal(first[1], again[1])
    assert torch.equal(first[2], again[2])
    assert checkpoint.load_streams(tmp_path, 5, 7) is None  # another rank's: never written


class Planted:
    """What an attacker pickles: unpickling it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_is_refused_and_its_payload_never_runs(tmp_path: Path) -> None:
    folder, marker = tmp_path / "checkpoints", tmp_path / "payload-ran"
    checkpoint.save({"step": 10}, folder, 10, keep=3)
    torch.save({"step": 20, "x": Planted(marker)}, folder / checkpoint.name_for(20))
    (folder / checkpoint.LATEST).write_text(checkpoint.name_for(20))
    with pytest.raises(UntrustedCheckpoint, match="holds os.system, which hpc_ddp does not "
                                                  "unpickle.*someone planted the file"):
        checkpoint.load_usable(folder)  # refused, not skipped for the good step 10
    assert not marker.exists()


@pytest.mark.parametrize("mode, who", [(0o666, "others"), (0o664, "your group")])
def test_a_checkpoint_others_can_write_is_refused(tmp_path: Path, mode: int, who: str) -> None:
    checkpoint.save({"step": 10}, tmp_path, 10, keep=3)
    path = tmp_path / checkpoint.name_for(10)
    path.chmod(mode)
    with pytest.raises(UntrustedCheckpoint, match=f"is writable by {who} .* chmod go-w {path}"):
        checkpoint.load_latest(tmp_path)
    path.chmod(0o640)
    tmp_path.chmod(0o777)  # the folder too: a file there can be replaced
    with pytest.raises(UntrustedCheckpoint, match=f"{tmp_path} is writable by others"):
        checkpoint.load_latest(tmp_path)
    tmp_path.chmod(0o750)
    assert checkpoint.load_latest(tmp_path) == {"step": 10}


def test_a_checkpoint_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    checkpoint.save({"step": 10}, tmp_path, 10, keep=3)
    os.chown(tmp_path / checkpoint.name_for(10), 4321, 4321)
    with pytest.raises(UntrustedCheckpoint, match="is not yours: the file belongs to uid 4321"):
        checkpoint.load_latest(tmp_path)


@dataclasses.dataclass
class Point:
    x: int


def test_a_state_that_would_not_load_back_is_refused_when_written(tmp_path: Path) -> None:
    (writer,) = writers(tmp_path, 1)
    writer.save(1, {"a": np.zeros(3)}, {})
    with pytest.raises(CheckpointError, match=r"not saved: .*numpy.*torch.from_numpy.*"
                                              r"add_safe_globals"):
        writer.wait()
    assert checkpoint.latest_path(tmp_path) is None and not list(tmp_path.glob("*.pt"))
    writer.save(2, {"p": Point(3)}, {})
    with pytest.raises(CheckpointError, match="Point"):
        writer.wait()
    with torch.serialization.safe_globals([Point]):  # a type the user trusts, allowed
        writer.save(3, {"p": Point(3)}, {})
        writer.wait()
        assert checkpoint.load_latest(tmp_path) == {"p": Point(3)}


def test_a_rank_keeps_the_streams_of_kept_checkpoints_and_its_newest_two(tmp_path: Path) -> None:
    (writer,) = writers(tmp_path, 1)
    for step in (10, 20, 30, 40):
        writer.save(step, {"step": step}, {"step": step})
        writer.wait()
    kept = sorted(p.name for p in tmp_path.glob("step_*.pt"))
    assert kept == [checkpoint.name_for(30), checkpoint.name_for(40)]
    # Rank 0's streams are those of the steps it keeps (docs/run-directory.md), not one more:
    # its streams are pruned before its own step file is, by the steps it will keep.
    mine = sorted(p.name for p in (tmp_path / "rng" / "rank0").iterdir())
    assert mine == kept
    # Rank 1, with rank 0's files at 30 and 40 (keep 2), writes 50 before rank 0 has: rank 0
    # will keep 40 and 50, and so does rank 1 (not 30, which rank 0 is about to prune).
    for step in (10, 20, 30, 40, 50):
        checkpoint.write_streams(tmp_path, 1, step, {})
    checkpoint.prune_streams(tmp_path, 1, 50, keep=2)
    assert sorted(p.name for p in (tmp_path / "rng" / "rank1").iterdir()) == [
        checkpoint.name_for(40), checkpoint.name_for(50)]


def test_a_resume_of_a_checkpoint_others_could_write_is_refused_at_submission(
        tmp_path: Path) -> None:
    import dataclasses

    from hpc_ddp.config.compose import compose
    from hpc_ddp.errors import UserError
    from hpc_ddp.inputs.resume_check import check_resumable
    from hpc_ddp.rundir import RunDir

    run = RunDir(tmp_path)
    cfg = dataclasses.replace(compose([]), resume=True, entry="tests.usercode.entries:counts")
    checkpoint.save({"step": 10}, run.checkpoints, 10, keep=3)
    check_resumable(cfg, run)  # the user's own, writable by no one else: fine
    run.checkpoints.chmod(0o775)
    with pytest.raises(UserError, match=f"run_dir={tmp_path}: {run.checkpoints} is writable by "
                                        "your group"):
        check_resumable(cfg, run)
