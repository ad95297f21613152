"""The warm process's socket folder (rank/warm/client.py): one of this user's alone; a planted
one (a link, a folder others may enter) is passed over, never used."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_ddp.rank.warm import client, tidy


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # A socket's path must fit sun_path (108 bytes): pytest's own tmp_path under xdist
    # (/tmp/pytest-of-root/pytest-194/popen-gw1/test_...) can be too long, and folder() then
    # rightly passes it over, which is the case test_a_folder_too_long_for_a_socket_is_passed_over
    # checks on purpose.
    made = Path(tempfile.mkdtemp(prefix="w", dir="/tmp"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


def test_a_planted_link_or_open_folder_is_passed_over(short_tmp: Path) -> None:
    tmp_path = short_tmp
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    elsewhere = tmp_path / "theirs"
    elsewhere.mkdir(mode=0o777)
    (runtime / "hpc_ddp-warm").symlink_to(elsewhere)
    found = client.folder({"XDG_RUNTIME_DIR": str(runtime)})
    assert found == Path("/tmp") / f"hpc_ddp-warm-{os.geteuid()}"
    (runtime / "hpc_ddp-warm").unlink()
    (runtime / "hpc_ddp-warm").mkdir(mode=0o700)
    os.chmod(runtime / "hpc_ddp-warm", 0o777)  # others may enter: not ours alone
    assert client.folder({"XDG_RUNTIME_DIR": str(runtime)}) != runtime / "hpc_ddp-warm"
    os.chmod(runtime / "hpc_ddp-warm", 0o700)
    assert client.folder({"XDG_RUNTIME_DIR": str(runtime)}) == runtime / "hpc_ddp-warm"


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a second user's folder needs root")
def test_a_folder_another_user_made_is_passed_over(short_tmp: Path) -> None:
    """A second user made the socket folder first (mode 0700, theirs): a warm process there
    would serve them, so the folder is passed over for this user's own in /tmp."""
    runtime = short_tmp / "run"
    runtime.mkdir(mode=0o700)
    planted = runtime / "hpc_ddp-warm"
    planted.mkdir(mode=0o700)
    os.chown(planted, 65534, 65534)  # nobody's
    assert client.folder({"XDG_RUNTIME_DIR": str(runtime)}) == (
        Path("/tmp") / f"hpc_ddp-warm-{os.geteuid()}")
    assert planted.stat().st_uid == 65534 and not any(planted.iterdir())  # left as it was


def test_a_folder_too_long_for_a_socket_is_passed_over(short_tmp: Path) -> None:
    runtime = short_tmp / ("x" * 90)
    runtime.mkdir(mode=0o700)
    assert client.folder({"XDG_RUNTIME_DIR": str(runtime)}) == (
        Path("/tmp") / f"hpc_ddp-warm-{os.geteuid()}")


def test_no_launch_no_warm_start() -> None:
    assert client.refused({}) is not None and "no launch id" in str(client.refused({}))
    assert client.refused({"HPC_DDP_WARM": "0", "HPC_DDP_LAUNCH_ID": "x"}) == (
        "cold: cluster.warm_start=false")


def test_the_sweep_removes_a_gone_launchs_lock_and_nothing_else(short_tmp: Path) -> None:
    """Locks left by launches killed before their starter removed them: an hour old, no
    socket, nobody holding them. A new one, a held one and one beside a socket stay."""
    place = short_tmp
    gone, new, held, paired = (place / f"{name}.lock" for name in ("gone", "new", "held", "paired"))
    for lock in (gone, new, held, paired):
        lock.touch(mode=0o600)
    # A kept warm process's log (client._start_once) goes the same way as its lock.
    old_log, new_log = place / "gone.log", place / "new.log"
    old_log.write_text("Traceback ...\n")
    new_log.write_text("Traceback ...\n")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a live launch's
    listening.bind(str(place / "paired.sock"))
    listening.listen(1)
    hour_ago = time.time() - 2 * 3600
    for lock in (gone, held, paired, old_log):
        os.utime(lock, (hour_ago, hour_ago))
    holder = os.open(held, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        tidy.sweep(place, place / "mine.sock")
    finally:
        os.close(holder)
        listening.close()
    assert not gone.exists() and not old_log.exists()
    assert new.exists() and held.exists() and paired.exists() and new_log.exists()
