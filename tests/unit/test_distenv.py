"""Rank, local rank, world size and node from the environment (tables of env dicts)."""

from __future__ import annotations

import pytest

from hpc_ddp.rank.join.distenv import LaunchError, detect

SLURM_STEP = {
    "SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8", "SLURM_NODEID": "2", "SLURM_NNODES": "4",
    "SLURM_JOB_NODELIST": "gpu[07-08],rack2-n[1-2]", "SLURM_TASKS_PER_NODE": "2(x4)",
}


def test_slurm_step() -> None:
    env = detect(SLURM_STEP)
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (5, 1, 8, 2)
    assert env.num_nodes == 4 and env.local_world_size == 2 and env.source == "slurm"
    assert env.master_addr is None  # rank 0 publishes its address; no guess from the list
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


# What Slurm 22.05 gave the tasks of `srun -N2 -r2` inside `salloc -N4` on the test cluster:
# the job's lists name all four nodes, the step's only the 3rd and 4th.
PARTIAL_STEP = {
    "SLURM_JOB_ID": "7474", "SLURM_STEP_ID": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "node[1-4]", "SLURM_NODELIST": "node[1-4]",
    "SLURM_STEP_NODELIST": "node[3-4]", "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
}


def test_a_step_on_part_of_the_allocation_uses_the_steps_nodes() -> None:
    env = detect(PARTIAL_STEP)
    assert env.nodes == ("node3", "node4") and env.expected_host(0) == "node3"
    assert (env.rank, env.world_size, env.node_rank, env.num_nodes) == (1, 2, 1, 2)
    assert env.master_addr is None and env.job_id == "7474.1"


def test_a_users_master_addr_is_kept() -> None:
    assert detect({**PARTIAL_STEP, "MASTER_ADDR": "ib-node3"}).master_addr == "ib-node3"


@pytest.mark.parametrize("outer", [
    # an `srun --pty bash` shell on a compute node: a step's identity, rank 0 of 1
    {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
    # an salloc shell of a 4-task allocation
    {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"},
])
def test_local_ranks_inside_an_allocation_never_take_slurms_identity(
        outer: dict[str, str]) -> None:
    envs = [detect({**outer, "SUBMITIT_LOCAL_GLOBALID": str(r), "SUBMITIT_LOCAL_NTASKS": "2",
                    "SUBMITIT_LOCAL_JOB_ID": "4242"}) for r in range(2)]
    assert [(e.source, e.rank, e.world_size) for e in envs] == [("local", 0, 2), ("local", 1, 2)]
    assert {e.job_id for e in envs} == {"4242"}


def test_a_heterogeneous_job_is_refused_saying_what_to_do() -> None:
    with pytest.raises(LaunchError) as info:
        detect({**SLURM_STEP, "SLURM_HET_SIZE": "2"})
    assert "SLURM_HET_SIZE=2" in str(info.value) and "not support" in str(info.value)
    assert "nodes=" in str(info.value)


@pytest.mark.parametrize("environ, script, supervise, gpus, device, in_place, expected", [
    ({"SLURM_STEP_ID": "0"}, None, True, 0, "auto", 0, True),           # asked for
    ({"SLURM_STEP_ID": "0"}, None, None, 4, "auto", 0, True),           # unset, GPUs: NCCL
    ({"SLURM_STEP_ID": "0"}, None, None, 0, "auto", 3, True),           # unset: restarts
    ({"SLURM_STEP_ID": "0"}, None, None, 0, "auto", 0, False),          # CPU, no restarts
    ({"SLURM_STEP_ID": "0"}, None, None, 4, "cpu", 0, False),           # GPUs held, CPU
    ({"SLURM_STEP_ID": "0"}, None, False, 4, "auto", 3, False),         # supervise=false
    ({"SLURM_STEP_ID": "0"}, "train.py", True, 4, "auto", 3, False),    # scripts: their own
    ({}, None, True, 4, "auto", 3, False),                              # local
    ({"SLURM_STEP_ID": "0", "HPC_DDP_PROGRAM_CONFIG": "x"}, None, True, 4, "auto", 3, False),
    ({"SLURM_STEP_ID": "0", "TORCHELASTIC_RUN_ID": "j"}, None, True, 4, "auto", 3, False),
])
def test_which_tasks_run_their_training_under_a_supervisor(
        environ: dict[str, str], script: str | None, supervise: bool | None, gpus: int,
        device: str, in_place: int, expected: bool) -> None:
    import dataclasses

    from hpc_ddp.config.schema import Config
    from hpc_ddp.rank.supervise.program import wanted

    cfg = Config()
    cfg = dataclasses.replace(
        cfg, script=script, trainer=dataclasses.replace(cfg.trainer, device=device),
        cluster=dataclasses.replace(cfg.cluster, supervise=supervise, gpus_per_node=gpus,
                                    restarts_in_place=in_place))
    assert wanted(cfg, environ) is expected


def test_a_local_run_is_named_by_its_launch_not_by_a_pid_that_comes_back() -> None:
    env = detect({"SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_NTASKS": "2",
                  "SUBMITIT_LOCAL_JOB_ID": "4242", "HPC_DDP_LAUNCH_ID": "9f3a1c2b7d0e"})
    assert env.job_id == "9f3a1c2b7d0e"


@pytest.mark.parametrize("environ, launch, submitted", [
    # A Slurm job: its step is this launch's; the job is what sbatch printed.
    (SLURM_STEP, "812.0", "812"),
    # An array task (a sweep point): its own SLURM_JOB_ID, but submitted as 40_3.
    ({**SLURM_STEP, "SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40",
      "SLURM_ARRAY_TASK_ID": "3"}, "43.0", "40_3"),
    # A local run: a launch id of its own (a pid comes back); submitit's job id is the pid.
    ({"SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_NTASKS": "2",
      "SUBMITIT_LOCAL_JOB_ID": "4242", "HPC_DDP_LAUNCH_ID": "9f3a1c2b7d0e"},
     "9f3a1c2b7d0e", "4242"),
])
def test_the_id_to_quote_is_the_one_the_job_was_submitted_as(
        environ: dict[str, str], launch: str, submitted: str) -> None:
    """summary.json's job_id is job.json's (what squeue and scancel take, what the submit
    command printed); the launch's own id names its rendezvous files."""
    env = detect(environ)
    assert (env.job_id, env.submitted_id) == (launch, submitted)
