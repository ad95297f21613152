"""A run as a step of the allocation a shell is in (launch/step.py): the allocation read from
the environment Slurm gives salloc/sbatch/srun shells, what fits it, the srun line."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.config.compose import compose
from hpc_ddp.errors import UserError
from hpc_ddp.launch import step
from hpc_ddp.launch.resolve import resolve
from hpc_ddp.rank.contract import TASK_ENV
from hpc_ddp.slurm.requeue import slurm_job

# As Slurm 22.05 sets them (recorded on the test cluster): an `salloc -N2` shell, a batch
# script, and the shell of `srun -N1 -n1 bash` inside the allocation.
SALLOC = {"SLURM_JOB_ID": "16", "SLURM_JOB_NODELIST": "node[1-2]",
          "SLURM_JOB_CPUS_PER_NODE": "1(x2)", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2"}
BATCH = {**SALLOC, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_CPUS_ON_NODE": "1"}
SRUN_SHELL = {**BATCH, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_NTASKS": "1",
              "SLURM_STEP_NODELIST": "node1", "SLURM_CPU_BIND": "quiet,mask_cpu:0x1"}


@pytest.mark.parametrize(("environ", "nodes", "cpus", "in_step"), [
    (SALLOC, ("node1", "node2"), (1, 1), False),
    (BATCH, ("node1", "node2"), (1, 1), False),
    ({**BATCH, "SLURM_STEP_ID": "batch"}, ("node1", "node2"), (1, 1), False),
    (SRUN_SHELL, ("node1", "node2"), (1, 1), True),
    ({**SALLOC, "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_JOB_CPUS_PER_NODE": "64(x2),32"},
     ("gpu01", "gpu02", "gpu03"), (64, 64, 32), False),
    ({**SALLOC, "SLURM_JOB_CPUS_PER_NODE": "8"}, ("node1", "node2"), (8, 8), False),
])
def test_the_allocation_a_shell_is_in(environ: dict[str, str], nodes: tuple[str, ...],
                                      cpus: tuple[int, ...], in_step: bool) -> None:
    found = step.allocation(environ)
    assert found is not None
    assert (found.job_id, found.nodes, found.cpus, found.in_step) == ("16", nodes, cpus, in_step)


@pytest.mark.parametrize("environ", [{}, {"SLURM_JOB_ID": "5"}, {"PATH": "/bin"},
                                     {**SALLOC, "SLURM_JOB_NODELIST": "node[3-1"}])
def test_no_allocation(environ: dict[str, str]) -> None:
    assert step.allocation(environ) is None


@pytest.mark.parametrize(("value", "gpus"), [("4", 4), ("a100:8", 8), ("", None)])
def test_gpus_of_the_allocation(value: str, gpus: int | None) -> None:
    found = step.allocation({**SALLOC, "SLURM_GPUS_PER_NODE": value})
    assert found is not None and found.gpus_per_node == gpus


def test_the_srun_line_of_a_step() -> None:
    cfg = resolve(compose(["cluster=step", "nodes=2", "cluster.tasks_per_node=4",
                           "cluster.cpus_per_task=8", "cluster.gpus_per_node=4",
                           "cluster.exclude=node7", "cluster.srun_args=['--mpi=none']"]),
                  {**SALLOC, "PATH": "/nonexistent"}, Path("/tmp"))
    alloc = step.allocation(SALLOC)
    assert alloc is not None
    argv = step.command(cfg, alloc, "/opt/py/bin/python")
    assert argv == ["srun", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4",
                    "--cpus-per-task=8", "--kill-on-bad-exit=1", "--job-name=hpc_ddp",
                    "--signal=USR2@120", "--gpus-per-node=4", "--exclude=node7", "--mpi=none",
                    "/opt/py/bin/python", "-u", "-m", "hpc_ddp.rank.main.step"]
    inside = step.allocation(SRUN_SHELL)
    assert inside is not None and "--overlap" in step.command(cfg, inside, "python")


def test_a_step_leaves_the_shell_steps_binding_and_is_never_requeued(tmp_path: Path) -> None:
    alloc = step.allocation(SRUN_SHELL)
    assert alloc is not None
    env = step.step_environment(SRUN_SHELL, alloc, tmp_path / "task.pkl")
    assert not any(k.startswith("SLURM_CPU_BIND") for k in env)
    assert env[TASK_ENV] == str(tmp_path / "task.pkl")
    assert slurm_job(SRUN_SHELL) == "16" and slurm_job(env) is None


@pytest.mark.parametrize(("overrides", "key"), [
    (["nodes=3"], "nodes"),
    (["cluster.tasks_per_node=2"], "cluster.tasks_per_node"),
    (["cluster.cpus_per_task=2"], "cluster.tasks_per_node"),
])
def test_what_does_not_fit_the_allocation_is_refused(overrides: list[str], key: str) -> None:
    cfg = resolve(compose(["cluster=step", *overrides]), {**SALLOC, "PATH": "/x"}, Path("/tmp"))
    alloc = step.allocation(SALLOC)
    assert alloc is not None
    with pytest.raises(UserError) as caught:
        step.check(cfg, alloc)
    assert caught.value.key == key and "allocation 16" in caught.value.message


def test_more_gpus_than_the_allocation_has_are_refused() -> None:
    environ = {**SALLOC, "SLURM_GPUS_PER_NODE": "2", "SLURM_JOB_CPUS_PER_NODE": "16(x2)"}
    cfg = resolve(compose(["cluster=step", "cluster.gpus_per_node=4"]), environ, Path("/tmp"))
    alloc = step.allocation(environ)
    assert alloc is not None
    with pytest.raises(UserError, match="cluster.gpus_per_node=2 or fewer"):
        step.check(cfg, alloc)


def test_a_step_takes_the_allocations_gpus_unless_told(tmp_path: Path) -> None:
    environ = {**SALLOC, "SLURM_GPUS_PER_NODE": "4", "PATH": "/x"}
    cfg = resolve(compose(["cluster=step"]), environ, tmp_path)
    assert (cfg.cluster.gpus_per_node, cfg.cluster.tasks_per_node, cfg.wait) == (4, 4, True)
    cpu = resolve(compose(["cluster=step", "cluster.gpus_per_node=0"]), environ, tmp_path)
    assert (cpu.cluster.gpus_per_node, cpu.cluster.tasks_per_node) == (0, 1)


def test_a_step_outside_an_allocation_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cluster=slurm to submit a job"):
        resolve(compose(["cluster=step"]), {"PATH": "/x"}, tmp_path)


def test_auto_outside_a_reachable_slurm_stays_local_even_in_an_allocation(
        tmp_path: Path) -> None:
    # No controller answers (no scontrol here): local, whatever SLURM_* the shell carries.
    assert resolve(compose([]), {**SALLOC, "PATH": "/x"}, tmp_path).cluster.kind == "local"
