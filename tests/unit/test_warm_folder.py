"""The warm process's socket folder (rank/warm/client.py): one of this user's alone; a planted
one (a link, a folder others may enter) is passed over, never used."""

from __future__ import annotations

import os
from pathlib import Path

from hpc_ddp.rank.warm import client


def test_a_planted_link_or_open_folder_is_passed_over(tmp_path: Path) -> None:
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


def test_no_launch_no_warm_start() -> None:
    assert client.refused({}) is not None and "no launch id" in str(client.refused({}))
    assert client.refused({"HPC_DDP_WARM": "0", "HPC_DDP_LAUNCH_ID": "x"}) == (
        "cold: cluster.warm_start=false")
