"""A local run's warm process kept for the next run (hpc_ddp/rank/warm/kept.py): which runs one
may serve. Real processes where the fact is the process's own (niceness); the runs themselves
are tests/integration/test_warm_start.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.rank.contract import LAUNCH_ID_ENV, WARM_KEEP_ENV
from hpc_ddp.rank.warm import client, kept
from tests.conftest import REPO, command_env, compose_refusal

BASE = {"PATH": "/usr/bin:/bin", "HOME": "/home/ada", "TORCH_LOGS": "", LAUNCH_ID_ENV: "a1",
        WARM_KEEP_ENV: "120", "MASTER_PORT": "29500"}


def test_a_run_that_keeps_nothing_or_is_no_local_launch_has_no_kept_key() -> None:
    assert kept.key({**BASE, WARM_KEEP_ENV: "0"}) is None
    assert kept.key({**BASE, WARM_KEEP_ENV: "soon"}) is None
    assert kept.key({k: v for k, v in BASE.items() if k != WARM_KEEP_ENV}) is None
    assert kept.key({k: v for k, v in BASE.items() if k != LAUNCH_ID_ENV}) is None
    # A Slurm step is never kept: its key names the job, step, attempt and node.
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "n1",
            WARM_KEEP_ENV: "120"}
    assert client.launch_key(step) == "slurm 7 0 0 n1"


def test_runs_that_differ_only_in_their_own_variables_share_one() -> None:
    first = kept.key(BASE)
    assert first is not None and first.startswith("kept ")
    other = {**BASE, LAUNCH_ID_ENV: "b2", "MASTER_PORT": "29611", "HPC_DDP_RUN_DIR": "/r/2",
             "HPC_DDP_STORE_KEY": "s3cr3t", "SUBMITIT_LOCAL_JOB_ID": "99", "RANK": "1",
             "PYTEST_CURRENT_TEST": "t.py::x (call)", "CUDA_VISIBLE_DEVICES": "1"}
    assert kept.key(other) == first
    assert client.launch_key(other) == first  # the socket's name follows
    # None of a run's own variables stays in the environment the kept process starts with.
    shared = kept.shared_environment(other)
    assert shared == {"PATH": "/usr/bin:/bin", "HOME": "/home/ada", "TORCH_LOGS": ""}


@pytest.mark.parametrize("change", [{"TORCH_LOGS": "+dynamo"}, {"PYTHONPATH": "/elsewhere"},
                                    {"HOME": "/home/bob"}, {WARM_KEEP_ENV: "30"}])
def test_an_environment_read_at_import_gets_a_warm_process_of_its_own(
        change: dict[str, str]) -> None:
    assert kept.key({**BASE, **change}) != kept.key(BASE)


def test_an_install_into_a_folder_on_sys_path_gets_a_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    before = kept.key(BASE)
    (tmp_path / "newpkg").mkdir()  # what pip does: a folder appears, the folder's time moves
    assert kept.key(BASE) != before
    assert str(Path(kept.__file__).resolve()) in kept.files()  # hpc_ddp's own files count


def test_what_a_run_writes_into_its_own_folder_keeps_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m` puts the run's folder first on sys.path; runs write there (outputs/)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = kept.key(BASE)
    (tmp_path / "outputs").mkdir()
    assert kept.key(BASE) == before


def test_a_niced_run_gets_a_warm_process_of_its_own() -> None:
    """A fork inherits its warm process's niceness, which a user's process cannot lower."""
    code = ("import json, sys\nfrom hpc_ddp.rank.warm import kept\n"
            "print(kept.key(json.loads(sys.argv[1])))")
    keys = [subprocess.run([*nice, sys.executable, "-c", code, json.dumps(BASE)], cwd=REPO,
                           env=command_env(), capture_output=True, text=True, check=True
                           ).stdout.strip() for nice in ([], ["nice", "-n", "5"])]
    assert keys[0].startswith("kept ") and keys[0] != keys[1]


def test_a_negative_keep_is_refused_naming_the_fix() -> None:
    message = compose_refusal(["cluster.warm_keep_s=-1"])
    assert message.startswith("cluster.warm_keep_s=-1") and "cluster.warm_keep_s to 0" in message
