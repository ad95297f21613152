"""The test cluster itself: it must behave like a real multi-node Slurm cluster."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpc_ddp.testcluster.cluster import TestCluster
from tests.cluster.slurm_final import assert_completed

pytestmark = pytest.mark.cluster


def run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def srun_lines(args: list[str], script: str, env: dict[str, str]) -> list[list[str]]:
    """Run ``script`` in every task of an srun step; one whitespace-split line per task."""
    out = run(["srun", *args, "sh", "-c", script], env)
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return sorted(rows, key=lambda words: int(words[0]))


def test_sinfo_shows_idle_nodes_with_gpus_in_both_partitions(
    slurm_cluster: TestCluster, slurm_env: dict[str, str]
) -> None:
    out = run(["sinfo", "-h", "-N", "-o", "%N %P %t %G"], slurm_env)
    rows = {tuple(line.split()) for line in out.splitlines()}
    expected = {
        (node, part, "idle", "gpu:2")
        for node in slurm_cluster.node_names
        for part in ["normal*", "urgent"]
    }
    assert rows == expected


def test_preemption_settings_are_live(slurm_env: dict[str, str]) -> None:
    config = run(["scontrol", "show", "config"], slurm_env)
    assert re.search(r"PreemptType\s*=\s*preempt/partition_prio", config)
    assert re.search(r"MaxArraySize\s*=\s*10\b", config)
    normal = run(["scontrol", "show", "partition", "normal"], slurm_env)
    assert "PriorityTier=1" in normal and "GraceTime=30" in normal
    assert "PreemptMode=REQUEUE" in normal
    assert "PriorityTier=2" in run(["scontrol", "show", "partition", "urgent"], slurm_env)


def test_srun_spans_four_namespaced_nodes(
    slurm_cluster: TestCluster, slurm_env: dict[str, str]
) -> None:
    rows = srun_lines(
        ["-N4", "--ntasks-per-node=2"],
        # hostname -I last: it also prints the ib0 fabric's IPv6 address.
        'echo "$SLURM_PROCID $(hostname) $SLURMD_NODENAME $(hostname -I)"',
        slurm_env,
    )
    assert [int(r[0]) for r in rows] == list(range(8))
    hosts = {r[1] for r in rows}
    assert hosts == set(slurm_cluster.node_names)
    # Each node answers with its own address, the one in /etc/hosts and slurm.conf.
    assert {(r[1], r[3]) for r in rows} == set(slurm_cluster.node_addresses.items())
    assert all(r[1] == r[2] for r in rows)


def test_sbatch_wait_then_sacct_completed(slurm_cluster: TestCluster, slurm_env: dict[str, str],
                                          tmp_path: Path) -> None:
    out = run(
        [
            "sbatch",
            "--parsable",
            "--wait",
            "-N1",
            f"--output={tmp_path}/%j.out",
            "--wrap",
            "echo hello from $(hostname)",
        ],
        slurm_env,
    )
    job_id = out.strip().split(";")[0]
    assert (tmp_path / f"{job_id}.out").read_text().startswith(
        f"hello from {slurm_cluster.node_names[0]}")
    # slurmdbd records the end asynchronously: assert_completed reads until it has.
    assert_completed(job_id, slurm_env)


def test_batch_script_is_not_a_step_but_srun_tasks_are(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    # The batch shell carries SLURM_PROCID=0 and SLURM_NTASKS of the whole job, but no
    # SLURM_STEP_ID: code that takes ranks from SLURM_PROCID must check it is in a step.
    script = tmp_path / "job.sh"
    script.write_text(
        textwrap.dedent("""\
        #!/bin/sh
        echo "batch step=${SLURM_STEP_ID:-unset} procid=${SLURM_PROCID:-unset} ntasks=$SLURM_NTASKS"
        srun sh -c 'echo "task step=${SLURM_STEP_ID:-unset} procid=$SLURM_PROCID"'
        """)
    )
    run(
        ["sbatch", "--wait", "-N2", "--ntasks-per-node=1", f"--output={tmp_path}/out", str(script)],
        slurm_env,
    )
    lines = (tmp_path / "out").read_text().splitlines()
    assert lines[0] == "batch step=unset procid=0 ntasks=2"
    assert sorted(lines[1:]) == ["task step=0 procid=0", "task step=0 procid=1"]


def test_gpus_per_node_every_task_sees_all(slurm_env: dict[str, str]) -> None:
    rows = srun_lines(
        ["-N2", "--ntasks-per-node=2", "--gpus-per-node=2"],
        'echo "$SLURM_PROCID $CUDA_VISIBLE_DEVICES"',
        slurm_env,
    )
    assert [r[1] for r in rows] == ["0,1"] * 4


def test_gpus_per_task_each_task_its_own(slurm_env: dict[str, str]) -> None:
    rows = srun_lines(
        ["-N1", "--ntasks-per-node=2", "--gpus-per-task=1"],
        'echo "$SLURM_PROCID $CUDA_VISIBLE_DEVICES"',
        slurm_env,
    )
    devices = [r[1] for r in rows]
    assert len(devices) == 2 and len(set(devices)) == 2
    assert all("," not in d for d in devices)


GLOO_SCRIPT = """
import os, socket, torch, torch.distributed as dist
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", init_method="tcp://{first}:{port}", rank=rank, world_size=world)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(rank, socket.gethostname(), int(t.item()), flush=True)
dist.destroy_process_group()
"""


def test_gloo_all_reduce_across_namespaces_without_ifname(
    slurm_cluster: TestCluster, slurm_env: dict[str, str], tmp_path: Path
) -> None:
    # Nothing tells gloo which interface to use: it resolves the node's hostname through
    # /etc/hosts (the cluster's block) and finds eth0's address by itself.
    env = {k: v for k, v in slurm_env.items() if not k.startswith("GLOO_")}
    script = tmp_path / "allreduce.py"
    two = slurm_cluster.node_names[:2]
    script.write_text(GLOO_SCRIPT.format(first=two[0], port=29561))
    out = run(
        [
            "srun",
            "-N2",
            "--ntasks-per-node=2",
            f"--nodelist={','.join(two)}",
            "--export=ALL",
            sys.executable,
            str(script),
        ],
        env,
        timeout=180,
    )
    rows = sorted(line.split() for line in out.splitlines() if line.strip())
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert {r[1] for r in rows} == set(two)
    assert {r[2] for r in rows} == {"10"}  # 1 + 2 + 3 + 4


def test_up_again_reuses_the_healthy_cluster(slurm_cluster: TestCluster) -> None:
    assert slurm_cluster.up() is False
    assert slurm_cluster.status()["up"] is True


def test_status_reports_up(slurm_cluster: TestCluster) -> None:
    st = slurm_cluster.status()
    assert st["up"] is True
    assert st["nodes"] == {n: "idle" for n in slurm_cluster.node_names}
    assert all(pid for name, pid in st["daemons"].items() if name.startswith("slurm"))
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpc_ddp.testcluster",
            "status",
            "--state-dir",
            str(slurm_cluster.state_dir),
            "--instance",
            str(slurm_cluster.config.instance),
        ],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "cluster: UP" in cli.stdout


def test_a_nodes_own_variables_reach_only_its_tasks(slurm_cluster: TestCluster,
                                                    slurm_env: dict[str, str]) -> None:
    def seen() -> list[str]:
        done = subprocess.run(["srun", "-N4", "-l", "sh", "-c", 'echo "$(hostname) ${X:-}"'],
                              env=slurm_env, capture_output=True, text=True, timeout=60,
                              check=True)
        return sorted(line.split(": ", 1)[1] for line in done.stdout.splitlines())

    n1, n2, n3, n4 = slurm_cluster.node_names
    with slurm_cluster.node_environment(n3, {"X": "a b"}):
        assert seen() == [f"{n1} ", f"{n2} ", f"{n3} a b", f"{n4} "]
    assert seen() == [f"{n1} ", f"{n2} ", f"{n3} ", f"{n4} "]


def test_every_task_gets_passive_openmp_threads_unless_its_job_set_them(
        slurm_cluster: TestCluster, slurm_env: dict[str, str]) -> None:
    def seen(env: dict[str, str]) -> list[str]:
        done = subprocess.run(["srun", "-N4", "-l", "sh", "-c", 'echo "$OMP_WAIT_POLICY"'],
                              env=env, capture_output=True, text=True, timeout=60, check=True)
        return [line.split(": ", 1)[1] for line in done.stdout.splitlines()]

    bare = {k: v for k, v in slurm_env.items() if k != "OMP_WAIT_POLICY"}
    assert seen(bare) == ["PASSIVE"] * 4  # the nodes share this machine's cores
    assert seen({**bare, "OMP_WAIT_POLICY": "ACTIVE"}) == ["ACTIVE"] * 4


def test_settle_cancels_what_a_test_left_and_resumes_a_drained_node(
        slurm_cluster: TestCluster, slurm_env: dict[str, str]) -> None:
    from hpc_ddp.testcluster import settle

    held = run(["sbatch", "--parsable", "--hold", "-N1", "--wrap", "sleep 300"], slurm_env)
    node2 = slurm_cluster.node_names[1]
    run(["scontrol", "update", f"NodeName={node2}", "State=DRAIN", "Reason=left-by-a-test"],
        slurm_env)
    found = settle.settle(slurm_cluster.env(), slurm_cluster.node_names, grace_s=2)
    assert len(found) == 2, found
    assert found[0].startswith("jobs still queued") and held.strip() in found[0], found
    assert f"{node2} drain" in found[1] and "left-by-a-test" in found[1], found
    assert settle.jobs(slurm_env) == []
    assert {n: s for n, (s, _) in settle.node_states(slurm_env).items()} == {
        n: "idle" for n in slurm_cluster.node_names}
    assert settle.settle(slurm_cluster.env(), slurm_cluster.node_names) == []  # nothing left
