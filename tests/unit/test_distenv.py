"""Rank, local rank, world size and node from the environment (tables of env dicts)."""

from __future__ import annotations

import pytest

from hpc_ddp.rank.distenv import LaunchError, detect

SLURM_STEP = {
    "SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8", "SLURM_NODEID": "2", "SLURM_NNODES": "4",
    "SLURM_JOB_NODELIST": "gpu[07-08],rack2-n[1-2]", "SLURM_TASKS_PER_NODE": "2(x4)",
}


def test_slurm_step() -> None:
    env = detect(SLURM_STEP)
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (5, 1, 8, 2)
    assert env.num_nodes == 4 and env.local_world_size == 2 and env.source == "slurm"
    assert env.master_addr == "gpu07"
    assert env.nodes == ("gpu07", "gpu08", "rack2-n1", "rack2-n2")
    assert env.expected_host(5) == "rack2-n1" and env.expected_host(7) == "rack2-n2"
    assert env.job_id == "812.0" and env.restart == 0 and env.master_port is None


def test_slurm_uneven_tasks_and_restart_and_user_port() -> None:
    env = detect({**SLURM_STEP, "SLURM_TASKS_PER_NODE": "3,1(x2),3", "SLURM_NODEID": "3",
                  "SLURM_RESTART_COUNT": "2", "MASTER_PORT": "29600"})
    assert env.local_world_size == 3 and env.restart == 2 and env.master_port == 29600
    assert env.expected_host(3) == "gpu08" and env.expected_host(4) == "rack2-n1"


def test_torchrun_wins_over_slurm() -> None:
    env = detect({**SLURM_STEP, "RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "4",
                  "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "h1", "MASTER_PORT": "1234",
                  "GROUP_RANK": "3"})
    assert (env.source, env.rank, env.world_size, env.node_rank) == ("torchrun", 3, 4, 3)
    assert (env.master_addr, env.master_port) == ("h1", 1234)


def test_local_simulated_nodes() -> None:
    env = detect({"SUBMITIT_LOCAL_GLOBALID": "5", "SUBMITIT_LOCAL_NTASKS": "8",
                  "SUBMITIT_LOCAL_JOB_ID": "77"}, simulated_tasks_per_node=2)
    assert (env.rank, env.local_rank, env.node_rank, env.num_nodes) == (5, 1, 2, 4)
    assert env.master_addr == "127.0.0.1" and env.job_id == "77"


def test_plain_process_is_a_world_of_one() -> None:
    env = detect({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")


@pytest.mark.parametrize("environ, where", [
    ({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "8", "SLURM_PROCID": "0"}, "the batch script"),
    ({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4"}, "an salloc shell"),
])
def test_forgotten_srun_is_explained(environ: dict[str, str], where: str) -> None:
    with pytest.raises(LaunchError) as info:
        detect(environ)
    assert where in str(info.value) and "srun" in str(info.value)


def test_single_task_batch_job_runs_as_one_rank() -> None:
    env = detect({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
                  "SLURM_JOB_NODELIST": "n1"})
    assert env.world_size == 1 and env.rank == 0
