"""Atomic checkpoints: the latest one always loads, whatever moment the writer dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hpc_ddp.rank.services import checkpoint
from tests.checkpoint_kills import resumed_each_time


def test_save_points_latest_and_keeps_k(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        checkpoint.save({"step": step, "w": torch.full((3,), step)}, tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == [
        "step_000000030.pt", "step_000000040.pt"]
    state = checkpoint.load_latest(tmp_path)
    assert state is not None and state["step"] == 40
    assert torch.equal(state["w"], torch.full((3,), 40))


def test_no_checkpoint_is_none(tmp_path: Path) -> None:
    assert checkpoint.load_latest(tmp_path) is None


# A writer that saves step 1, then dies by SIGKILL right after the temp file is complete
# and before os.replace: the moment a non-atomic writer would lose everything.
_KILLED_BEFORE_REPLACE = textwrap.dedent("""
    import os, signal, sys, torch
    from hpc_ddp.rank.services import checkpoint
    folder = sys.argv[1]
    from pathlib import Path
    checkpoint.save({"step": 1}, Path(folder), 1, keep=3)
    def die(*args):
        os.kill(os.getpid(), signal.SIGKILL)
    os.replace = die
    checkpoint.save({"step": 2}, Path(folder), 2, keep=3)
""")


def test_killed_between_temp_file_and_replace_keeps_previous(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_REPLACE, str(tmp_path)],
                          check=False, timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert list(tmp_path.glob(".step_000000002.pt.*.tmp"))  # the half-done write is there
    state = checkpoint.load_latest(tmp_path)
    assert state is not None and state["step"] == 1


def test_sigkill_at_random_moments_never_breaks_latest(tmp_path: Path) -> None:
    # Background writers of a 2-rank world, killed 20 times (forked children of one
    # interpreter: tests/checkpoint_kills.py); the cluster test does it on every node.
    from tests.conftest import REPO

    done = subprocess.run([sys.executable, "-m", "tests.checkpoint_kills", str(tmp_path), "20",
                           "1234"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["problems"] == [] and result["kills"] == 20
    assert resumed_each_time(result), result  # it went on across the kills
    steps = [s for s in result["steps"] if s is not None]
    assert steps == sorted(steps) and len(set(steps)) >= 2, result  # and saved in between


@pytest.fixture
def small_fs(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real 2 MiB tmpfs: the disk really fills up (needs root to mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    # mode 755: a world-writable tmpfs (its default 1777) would be refused
    # (rank/services/trusted.py).
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=755", "tmpfs", str(mount)],
                   check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_is_clear_and_keeps_previous(small_fs: Path) -> None:
    checkpoint.save({"step": 1}, small_fs, 1, keep=3)
    with pytest.raises(checkpoint.CheckpointError, match="still the latest") as info:
        checkpoint.save({"step": 2, "w": torch.zeros(1024, 1024)}, small_fs, 2, keep=3)
    assert "No space left" in str(info.value)
    assert checkpoint.load_latest(small_fs) == {"step": 1}
    assert not list(small_fs.glob(".*.tmp"))  # the partial file is cleaned up


def test_read_only_folder_is_clear_and_keeps_previous(small_fs: Path) -> None:
    checkpoint.save({"step": 1}, small_fs, 1, keep=3)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with pytest.raises(checkpoint.CheckpointError, match="Read-only file system"):
        checkpoint.save({"step": 2}, small_fs, 2, keep=3)
    assert checkpoint.load_latest(small_fs) == {"step": 1}


def _three(folder: Path) -> None:
    for step in (10, 20, 30):
        checkpoint.save({"step": step, "w": torch.full((3,), float(step))}, folder, step, keep=3)


@pytest.mark.parametrize("damage", ["truncated", "not a pickle", "missing"])
def test_an_unusable_latest_falls_back_to_the_one_before(tmp_path: Path, damage: str) -> None:
    _three(tmp_path)
    latest = tmp_path / checkpoint.name_for(30)
    if damage == "truncated":
        latest.write_bytes(latest.read_bytes()[:100])
    elif damage == "not a pickle":
        latest.write_bytes(b"\x00garbage" * 50)
    else:
        latest.unlink()
    state, skipped = checkpoint.load_usable(tmp_path)
    assert state is not None and state["step"] == 20
    assert [p.name for p, _ in skipped] == [latest.name] and skipped[0][1]
    event = checkpoint.fallback_event(skipped, 20, attempt=1)
    assert event["kind"] == "checkpoint_fallback" and latest.name in event["cause"]


def test_a_state_the_model_refuses_falls_back_and_none_usable_is_said(tmp_path: Path) -> None:
    _three(tmp_path)
    seen = []

    def accept(state: dict) -> None:  # type: ignore[type-arg]
        seen.append(state["step"])
        if state["step"] == 30:
            raise RuntimeError("size mismatch for w: copying a param with shape [3]")

    state, skipped = checkpoint.load_usable(tmp_path, accept=accept)
    assert state is not None and state["step"] == 20 and seen == [30, 20]
    assert "size mismatch" in skipped[0][1]

    def refuse(state: dict) -> None:  # type: ignore[type-arg]
        raise RuntimeError("wrong shapes")

    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load_usable(tmp_path, accept=refuse)
    assert all(checkpoint.name_for(s) in str(info.value) for s in (10, 20, 30))
