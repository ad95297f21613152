"""CPUs per task reach every rank (issue 14), on the test cluster with task/affinity.

The cluster runs without task binding for the rest of the suite (its four nodes share this
machine's two cores, see ClusterConfig.task_affinity); this module restarts it with
task/affinity, so each task is confined to the CPUs Slurm allocated it, and back after.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hpc_ddp.rundir import rank_records
from hpc_ddp.testcluster.cluster import TestCluster
from tests.cluster.slurm_final import assert_completed
from tests.cluster.test_slurm_submit import SMALL, job_id_of

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def bound_cluster(slurm_cluster: TestCluster) -> Iterator[TestCluster]:
    bound = TestCluster(task_affinity=True, instance=slurm_cluster.config.instance, say=print)
    bound.up()
    try:
        yield bound
    finally:
        slurm_cluster.up()  # the session's own configuration again


def records(run_dir: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(p.read_text()) for p in rank_records(run_dir / "ranks")]


@pytest.mark.parametrize(("nodes", "tasks", "cpus"), [(2, 1, 2), (1, 2, 1)])
def test_every_rank_gets_the_cpus_per_task_the_job_asked_for(
        nodes: int, tasks: int, cpus: int, bound_cluster: TestCluster, hpc_ddp: Run,
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    # srun is told --cpus-per-task (Slurm 22.05+ does not pass it from the job): every rank
    # runs on exactly that many cores (two ranks of one node on different ones) with as many
    # intra-op threads.
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=slurm", f"nodes={nodes}",
                              f"cluster.tasks_per_node={tasks}", f"cluster.cpus_per_task={cpus}",
                              "trainer.max_steps=4", "wait=true", f"run_dir={run_dir}", *SMALL],
                   env=slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_completed(job_id_of(done.stdout), slurm_env, done.stdout)
    found = records(run_dir)
    assert len(found) == nodes * tasks
    for record in found:
        assert len(record["cpus"]) == cpus and record["threads"] == cpus, record
    for host in {r["host"] for r in found}:
        cores = [tuple(r["cpus"]) for r in found if r["host"] == host]
        assert len(set(cores)) == len(cores), f"ranks on {host} share cores: {cores}"
    scripts = list((run_dir / "submitit").rglob("*_submission.sh"))
    assert any(f"--cpus-per-task={cpus}" in path.read_text() for path in scripts)
