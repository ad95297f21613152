"""The doctor on the real namespaced cluster: a per-node table, and exactly the bad node named.

One node is made to differ for real: every node reads its own sysfs tree (HPC_DDP_SYSFS_ROOT
with {host}, filled in on the node), and node3's InfiniBand port is DOWN with no peer-memory
module, while the others are ACTIVE with nvidia_peermem loaded (node3: the cluster's third
node, whatever its cluster calls it).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_ddp.testcluster.cluster import TestCluster
from tests.cluster.slurm_final import assert_completed
from tests.cluster.test_slurm_submit import job_id_of
from tests.unit.test_nodeinfo import make_sysfs

pytestmark = pytest.mark.cluster
Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def nodes(slurm_cluster: TestCluster) -> list[str]:
    return slurm_cluster.node_names


def trees(base: Path, nodes: list[str], bad: str | None) -> str:
    for host in nodes:
        state = "DOWN" if host == bad else "ACTIVE"
        make_sysfs(base / host, {"mlx5_0:1": state, "mlx5_1:1": "ACTIVE"},
                   peermem=None if host == bad else "nvidia_peermem")
    return str(base / "{host}")


def test_doctor_names_exactly_the_node_that_differs(hpc_ddp: Run, nodes: list[str],
                                                    slurm_env: dict[str, str],
                                                    tmp_path: Path) -> None:
    run_dir = tmp_path / "doc"
    node3 = nodes[2]
    env = {**slurm_env, "HPC_DDP_SYSFS_ROOT": trees(tmp_path / "sys", nodes, bad=node3)}
    done = hpc_ddp("doctor", ["--size-mib", "1", "cluster=slurm", "nodes=4",
                              f"run_dir={run_dir}"], env=env, timeout=300)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    report = json.loads((run_dir / "doctor.json").read_text())
    assert report["bad_nodes"] == [node3]
    assert sorted(report["nodes"]) == nodes and report["world_size"] == 4
    # The per-node table: one row per node, node3's port DOWN and marked FAIL, the rest ok.
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.split() and line.split()[0] in nodes}
    assert sorted(rows) == nodes
    assert "mlx5_0:1 DOWN" in rows[node3] and rows[node3].rstrip().endswith("FAIL")
    for host in (nodes[0], nodes[1], nodes[3]):
        assert "mlx5_0:1 ACTIVE" in rows[host] and rows[host].rstrip().endswith("ok"), rows
    # The findings name node3 and no other node.
    findings = [line for line in out.splitlines() if line.startswith(("FAIL", "warn"))]
    assert findings and all(re.search(rf"\] {node3}: ", line) for line in findings), findings
    assert any("ACTIVE IB ports" in line for line in findings)
    assert any("GPUDirect peer memory" in line for line in findings)
    verdict = out.strip().splitlines()[-2]
    assert verdict.startswith(f"doctor: FAIL. Bad node(s): {node3}. ")
    assert verdict.endswith(f"cluster.exclude='{node3}'")
    # The job itself ran every check to its end: the FAIL is the doctor's verdict, not Slurm's.
    assert_completed(job_id_of(out), slurm_env, out)


def test_healthy_nodes_pass_and_exclude_is_honoured(hpc_ddp: Run, nodes: list[str],
                                                    slurm_env: dict[str, str],
                                                    tmp_path: Path) -> None:
    """A resubmission with the printed exclude lands elsewhere and passes."""
    run_dir = tmp_path / "doc"
    node3 = nodes[2]
    env = {**slurm_env, "HPC_DDP_SYSFS_ROOT": trees(tmp_path / "sys", nodes, bad=node3)}
    done = hpc_ddp("doctor", ["--size-mib", "1", "cluster=slurm", "nodes=2",
                              "cluster.tasks_per_node=2", f"cluster.exclude='{node3}'",
                              f"run_dir={run_dir}"], env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((run_dir / "doctor.json").read_text())
    assert report["ok"] and report["bad_nodes"] == [] and report["world_size"] == 4
    assert len(report["nodes"]) == 2 and node3 not in report["nodes"]
    assert set(report["nodes"]) <= set(nodes)
    assert "doctor: ok, 2 node(s), 4 rank(s)." in done.stdout
    assert_completed(job_id_of(done.stdout), slurm_env, done.stdout)
    assert report["allreduce"]["correct"] and report["allreduce"]["busbw_gbps"] > 0
