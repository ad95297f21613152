"""One job per run dir: the claim in run_dir/owner.json, refused while its job lives."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpc_ddp.errors import UserError
from hpc_ddp.procs import start_time
from hpc_ddp.rank.join import owner

SLURM_7 = {"kind": "slurm", "job": "7", "host": "node1"}


def claim_over(tmp_path: Path, held: dict | None, mine: dict, alive: bool | None) -> None:  # type: ignore[type-arg]
    if held is not None:
        (tmp_path / owner.FILE).write_text(json.dumps(held))
    owner.claim(tmp_path, mine, "node2", {}, slurm_alive=lambda job, env: alive)


def test_a_live_slurm_owner_refuses_another_job(tmp_path: Path) -> None:
    with pytest.raises(UserError) as info:
        claim_over(tmp_path, SLURM_7, {"kind": "slurm", "job": "8", "host": "node2"}, True)
    assert "slurm job 7, which still runs" in info.value.message
    assert "scancel 7" in info.value.message
    assert json.loads((tmp_path / owner.FILE).read_text())["job"] == "7"  # untouched


@pytest.mark.parametrize("alive", [False, None])
def test_a_dead_or_unknown_owner_is_taken_over(tmp_path: Path, alive: bool | None) -> None:
    claim_over(tmp_path, SLURM_7, {"kind": "slurm", "job": "8", "host": "node2"}, alive)
    assert json.loads((tmp_path / owner.FILE).read_text())["job"] == "8"


def test_the_owning_job_claims_again_after_a_requeue(tmp_path: Path) -> None:
    claim_over(tmp_path, SLURM_7, dict(SLURM_7), True)  # same job, a later attempt
    assert json.loads((tmp_path / owner.FILE).read_text())["job"] == "7"


def test_a_local_owner_is_checked_by_pid_on_its_own_host(tmp_path: Path) -> None:
    me = os.getpid()
    held = {"kind": "local", "job": str(me), "host": "box", "started": start_time(me)}
    assert owner.alive(held, "box", {}) is True
    assert owner.alive({**held, "started": -1}, "box", {}) is False  # a reused pid
    assert owner.alive(held, "other-host", {}) is None


def test_who_claims(tmp_path: Path) -> None:
    assert owner.me({"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0"}, "n1") == {
        "kind": "slurm", "job": "12", "host": "n1"}
    # An array's task by its own name: squeue -j <array id> would list the whole array.
    assert owner.me({"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "12",
                     "SLURM_ARRAY_TASK_ID": "2"}, "n1")["job"] == "12_2"
    local = owner.me({"SUBMITIT_LOCAL_JOB_ID": str(os.getpid()), "SLURM_JOB_ID": "12"}, "box")
    assert local["kind"] == "local" and local["job"] == str(os.getpid())
