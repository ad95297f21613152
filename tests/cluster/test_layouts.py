"""Layouts of real use (issue 14), on the real cluster: a step on part of an allocation, two
concurrent steps on disjoint nodes, and local ranks started inside an allocation."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_ddp.rundir import rank_records
from hpc_ddp.testcluster.cluster import TestCluster
from tests.cluster.slurm_final import assert_completed, assert_ended
from tests.cluster.test_slurm_submit import SMALL, job_id_of
from tests.conftest import REPO, command_env
from tests.integration.test_warm_start import started

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]
TRAIN = [sys.executable, "-m", "hpc_ddp.train", "cluster.tasks_per_node=1",
         "trainer.max_steps=10", "trainer.rendezvous_timeout_s=60", *SMALL]


def in_allocation(nodes: int, script: str, env: dict[str, str],
                  timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``script`` run by bash inside ``salloc -N nodes`` (an interactive allocation's shell);
    its first line of output names the allocation (allocation_of)."""
    return subprocess.run(["salloc", f"-N{nodes}", "-Q", "bash", "-c",
                           f"echo allocation=$SLURM_JOB_ID; {script}"], cwd=REPO,
                          env=command_env(env), capture_output=True, text=True,
                          timeout=timeout, check=False)


def allocation_of(done: subprocess.CompletedProcess[str]) -> str:
    """The job id of in_allocation's allocation."""
    return done.stdout.split("allocation=", 1)[1].split()[0]


def summary(run_dir: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((run_dir / "summary.json").read_text())


def assert_step_completed(run_dir: Path, env: dict[str, str]) -> None:
    """Once salloc has returned: the run's step (summary.json's launch id,
    <allocation>.<step>) and its allocation ended COMPLETED 0:0 in Slurm, not only with a
    summary written."""
    step = str(summary(run_dir)["launch_id"])
    assert "." in step, f"not a step id: {step}"
    assert_completed(step, env)
    assert_completed(step.split(".")[0], env)


def test_steps_on_parts_of_an_allocation_train_side_by_side(slurm_cluster: TestCluster,
                                                            slurm_env: dict[str, str],
                                                            tmp_path: Path) -> None:
    # The 3rd and 4th nodes (rank 0 on the 3rd, which is not the allocation's first host), and
    # at the same time the 1st and 2nd: two rendezvous, one job id, two step ids.
    last, first = tmp_path / "last", tmp_path / "first"
    train = " ".join(map(shlex.quote, TRAIN))
    script = (f"srun -N2 -r2 {train} run_dir={last} & a=$!; "
              f"srun -N2 -r0 {train} run_dir={first} & b=$!; "
              "wait $a; x=$?; wait $b; y=$?; echo steps exited $x $y; [ $x$y = 00 ]")
    done = in_allocation(4, script, slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr
    nodes = slurm_cluster.node_names
    for run_dir, hosts in ((last, nodes[2:4]), (first, nodes[:2])):
        got = summary(run_dir)
        assert got["world_size"] == 2 and got["global_step"] == 10
        assert sorted(got["hosts"]) == hosts
        assert_step_completed(run_dir, slurm_env)
    endpoints = {p.name for run in (last, first) for p in (run / "rendezvous").iterdir()}
    assert len({name.split("-r")[0] for name in endpoints}) == 2  # job.step differs


@pytest.mark.parametrize("where", ["salloc shell", "srun shell on a node"])
def test_local_ranks_inside_an_allocation_are_their_own_world(
        where: str, slurm_env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    submit = " ".join(map(shlex.quote, [
        sys.executable, "-m", "hpc_ddp.submit", "cluster=local", "cluster.tasks_per_node=2",
        "trainer.max_steps=6", f"run_dir={run_dir}", *SMALL]))
    # An `srun --pty bash` shell: a step's identity (SLURM_PROCID=0 of SLURM_NTASKS=1).
    script = submit if where == "salloc shell" else f"srun -N1 -n1 {submit}"
    done = in_allocation(1, script, slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr
    got = summary(run_dir)
    assert got["world_size"] == 2 and got["global_step"] == 6
    ranks = [p.name for p in rank_records(run_dir / "ranks")]
    assert ranks == ["rank0.json", "rank1.json"], ranks
    assert "local job" in done.stdout
    assert_completed(allocation_of(done), slurm_env)  # local ranks: no step of their own


@pytest.mark.parametrize("where", ["salloc shell", "srun shell on a node"])
def test_submit_inside_an_allocation_runs_a_step_of_it(where: str, slurm_cluster: TestCluster,
                                                       slurm_env: dict[str, str],
                                                       tmp_path: Path) -> None:
    # cluster=auto inside an allocation: srun in it (no sbatch behind it, no queue wait). In
    # an `srun --pty bash`-like shell its own step holds CPUs (the new one needs --overlap);
    # there the run is also stopped as Ctrl-C stops it (SIGTERM to submit: the step's tasks
    # checkpoint at an agreed step) and resumed to its end in the same allocation.
    run_dir = tmp_path / "run"
    submit = " ".join(map(shlex.quote, [
        sys.executable, "-m", "hpc_ddp.submit", "nodes=2", "trainer.max_steps=100",
        "trainer.checkpoint_interval=10", f"run_dir={run_dir}", *SMALL]))
    progress = shlex.quote(str(run_dir / "progress.json"))
    script = submit
    if where != "salloc shell":
        inner = (f"{submit} & p=$!; until [ -f {progress} ]; do sleep 0.2; done; "
                 f"kill -TERM $p; wait $p; echo submit exited $?; {submit} resume=true")
        script = f"srun -N1 -n1 bash -c {shlex.quote(inner)}"
    done = in_allocation(2, script, slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr
    alloc = allocation_of(done)
    assert f"as a step of this shell's Slurm allocation {alloc}" in done.stdout, done.stdout
    job = json.loads((run_dir / "job.json").read_text())
    assert job["kind"] == "step" and job["job_id"] == alloc
    got = summary(run_dir)
    assert got["global_step"] == 100 and sorted(got["hosts"]) == slurm_cluster.node_names[:2]
    assert got["job_id"] == alloc  # as job.json: the allocation it ran in
    assert got["launch_id"].startswith(f"{alloc}.")  # a step of it, no other job
    if where != "salloc shell":
        assert "submit exited 143" in done.stdout and "Continue with:" in done.stdout
        assert 0 < got["resumed_from_step"] < 100, got
    # The step's ranks forked from their nodes' warm processes (stopped and resumed so).
    notes = started(run_dir)
    assert sorted(notes) == [0, 1] and all(n.startswith("warm: forked") for n in notes.values())
    assert_step_completed(run_dir, slurm_env)  # the step that finished (the resumed one)


def test_master_interface_is_the_fast_ipv6_only_network(
        hpc_ddp: Run, slurm_cluster: TestCluster, slurm_env: dict[str, str],
        tmp_path: Path) -> None:
    # The nodes' names resolve to eth0 (IPv4, "management"); ib0 carries only IPv6. Rank 0
    # publishes ib0's address, every rank reaches its store over IPv6, and Gloo runs on ib0.
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=2", "cluster.master_interface=ib0",
                              "trainer.max_steps=6", "wait=true", f"run_dir={run_dir}", *SMALL],
                   env=slurm_env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_completed(job_id_of(done.stdout), slurm_env, done.stdout)
    [published] = [json.loads(p.read_text()) for p in (run_dir / "rendezvous").glob("*.json")]
    assert published["addr"] == slurm_cluster.config.fast_addresses[published["host"]]
    for rank in (0, 1):
        record = json.loads((run_dir / "ranks" / f"rank{rank}.json").read_text())
        assert record["env"].get("GLOO_SOCKET_IFNAME") == "ib0", record["env"]
    assert summary(run_dir)["global_step"] == 6


def test_a_master_interface_rank_0_lacks_ends_every_rank_at_once_with_its_reason(
        hpc_ddp: Run, slurm_env: dict[str, str], tmp_path: Path) -> None:
    # Rank 0 publishes why it cannot serve where the others look for its address: they stop
    # at once with its reason, not after the whole rendezvous timeout (600 s here, longer
    # than the test may take) with a guess about the shared file system.
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", ["cluster=slurm", "nodes=2", "cluster.master_interface=nosuch0",
                              "trainer.rendezvous_timeout_s=600", "wait=true",
                              f"run_dir={run_dir}", *SMALL], env=slurm_env, timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    assert_ended(job_id_of(done.stdout), slurm_env, "FAILED", done.stdout)
    reason = "cluster.master_interface=nosuch0: rank 0's node "
    assert reason in (run_dir / "logs" / "rank0.error").read_text()
    said = (run_dir / "logs" / "rank1.error").read_text()
    assert f"rank 0 refused to start: {reason}" in said and "has no interface nosuch0" in said
    assert "shared" not in said


def test_torchrun_under_slurm_restarts_into_a_fresh_rendezvous(slurm_env: dict[str, str],
                                                               tmp_path: Path) -> None:
    # One torchrun per node (srun), torchrun's c10d rendezvous on the step's first node, one
    # restart allowed; rank 1 fails in the first attempt. hpc_ddp's ranks join torchrun's own
    # store (TORCHELASTIC_USE_AGENT_STORE) under a per-attempt prefix, so the second attempt
    # never reads the first one's check-ins.
    run_dir = tmp_path / "run"
    torchrun = " ".join([
        shlex.quote(sys.executable), "-m", "torch.distributed.run", "--nnodes=2",
        "--nproc-per-node=1", "--rdzv-backend=c10d", '--rdzv-endpoint="$head:29611"',
        '--rdzv-id="$SLURM_JOB_ID"', "--max-restarts=1", "-m", "hpc_ddp.train",
        "entry=tests.usercode.entries:fails_once", f"run_dir={shlex.quote(str(run_dir))}",
        "trainer.rendezvous_timeout_s=60"])
    script = ('head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1); '
              f"srun -N2 --ntasks-per-node=1 {torchrun}")
    done = in_allocation(2, script, slurm_env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Only a second attempt can end: in the first, rank 1 raised before the all-reduce.
    # (Rank 0's TORCHELASTIC_RESTART_COUNT may still say 0: torchrun counts failures, and
    # node1's agent restarted for a changed membership, so the ranks cannot go by it.)
    result = summary(run_dir)["result"]
    assert result["total"] == 1.0 and result["env_world"] == "2"
    # The script's one srun (step 0) ran both torchruns to the end, and so did salloc.
    alloc = allocation_of(done)
    assert_completed(f"{alloc}.0", slurm_env)
    assert_completed(alloc, slurm_env)
    assert "rank 1 fails in torchrun's first attempt" in (run_dir / "events.jsonl").read_text()


def test_a_second_job_on_a_run_dir_in_use_is_refused(slurm_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    from tests.cluster.test_slurm_submit import activated, sbatch_and_wait

    run_dir = tmp_path / "run"
    args = ["-N1", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1",
            "--time=10", str(REPO / "jobs" / "train.sbatch"), f"run_dir={run_dir}", *SMALL]
    first = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/first-%j.out",
                            *args, "trainer.max_steps=100000"], cwd=tmp_path,
                           env=activated(slurm_env), capture_output=True, text=True, check=True)
    job = first.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "progress.json").exists():  # the first one trains
            assert time.monotonic() < deadline, "the first job never started training"
            time.sleep(0.5)
        second, log = sbatch_and_wait([*args, "trainer.max_steps=200000", "resume=true"],
                                      tmp_path, activated(slurm_env))
        assert_ended(second, slurm_env, "FAILED", log)
        assert f"is being written by slurm job {job}, which still runs" in log, log
        assert f"scancel {job}" in log
        owner = json.loads((run_dir / "owner.json").read_text())
        assert owner["job"] == job  # the first job's claim stands
    finally:
        subprocess.run(["scancel", job], env=slurm_env, check=False)
