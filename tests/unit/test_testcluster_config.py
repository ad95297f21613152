"""The test cluster's configuration files, rendered without touching the machine."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.testcluster.config import (
    MAX_INSTANCES,
    ClusterConfig,
    default_state_dir,
    fingerprint,
    instance_settings,
    render_gres_conf,
    render_hosts_block,
    render_slurm_conf,
    render_slurmdbd_conf,
    render_task_prolog,
)
from hpc_ddp.testcluster.network import HOSTS_BEGIN, HOSTS_END, strip_block, with_block


def make(tmp_path: Path, **kwargs: object) -> ClusterConfig:
    return ClusterConfig(state_dir=tmp_path, controller_name="ctl", **kwargs)  # type: ignore[arg-type]


def conf_lines(cfg: ClusterConfig) -> list[str]:
    return render_slurm_conf(cfg).splitlines()


def test_default_shape(tmp_path: Path) -> None:
    cfg = make(tmp_path)
    assert cfg.node_names == ["node1", "node2", "node3", "node4"]
    assert cfg.node_addresses == {
        "node1": "10.77.0.11",
        "node2": "10.77.0.12",
        "node3": "10.77.0.13",
        "node4": "10.77.0.14",
    }
    assert cfg.controller_address == "10.77.0.1"
    assert cfg.netns("node1") == "hpcddp-node1"
    assert all(len(cfg.host_veth(n)) <= 15 for n in cfg.node_names)  # IFNAMSIZ


@pytest.mark.parametrize("nodes", [1, 2, 6, 12])
def test_nodes_and_addresses_follow_the_count(tmp_path: Path, nodes: int) -> None:
    cfg = make(tmp_path, nodes=nodes)
    node_lines = [line for line in conf_lines(cfg) if line.startswith("NodeName=")]
    assert len(node_lines) == nodes
    for i, line in enumerate(node_lines, start=1):
        assert line.startswith(f"NodeName=node{i} NodeAddr=10.77.0.{10 + i} CPUs=2 ")
    for part in ("normal", "urgent"):
        (line,) = [x for x in conf_lines(cfg) if x.startswith(f"PartitionName={part} ")]
        assert f"Nodes={','.join(cfg.node_names)} " in line


def test_partitions_and_preemption(tmp_path: Path) -> None:
    lines = conf_lines(make(tmp_path))
    normal = next(x for x in lines if x.startswith("PartitionName=normal "))
    urgent = next(x for x in lines if x.startswith("PartitionName=urgent "))
    for word in ("Default=YES", "PriorityTier=1", "GraceTime=30", "PreemptMode=REQUEUE"):
        assert word in normal.split()
    assert "PriorityTier=2" in urgent.split() and "Default=NO" in urgent.split()
    for key in (
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        "SlurmctldParameters=preempt_send_user_signal",
        "MaxArraySize=10",
        "JobRequeue=1",
        "InactiveLimit=0",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
    ):
        assert key in lines
    # 22.05 rejects PreemptParameters= (docs/testcluster.md).
    assert not any(x.startswith("PreemptParameters") for x in lines)


def test_controller_is_the_named_host_on_the_bridge(tmp_path: Path) -> None:
    assert "SlurmctldHost=ctl(10.77.0.1)" in conf_lines(make(tmp_path))


def test_paths_live_under_the_state_dir(tmp_path: Path) -> None:
    lines = conf_lines(make(tmp_path))
    assert f"SlurmdSpoolDir={tmp_path}/spool-%n" in lines
    assert f"SlurmdPidFile={tmp_path}/pids/slurmd-%n.pid" in lines
    assert f"StateSaveLocation={tmp_path}/ctld-state" in lines
    dbd = render_slurmdbd_conf(make(tmp_path)).splitlines()
    assert f"PidFile={tmp_path}/pids/slurmdbd.pid" in dbd
    assert "StorageLoc=hpc_ddp_testcluster_acct" in dbd


def test_gres_lines(tmp_path: Path) -> None:
    cfg = make(tmp_path)
    lines = conf_lines(cfg)
    assert "GresTypes=gpu" in lines
    assert all(" Gres=gpu:2 " in x for x in lines if x.startswith("NodeName="))
    assert render_gres_conf(cfg) == "Name=gpu File=/dev/fakegpu[0-1]\n"
    assert render_gres_conf(make(tmp_path, gpus=1)) == "Name=gpu File=/dev/fakegpu0\n"
    assert render_gres_conf(make(tmp_path, gpus=4)) == "Name=gpu File=/dev/fakegpu[0-3]\n"


def test_zero_gpus_disables_gres(tmp_path: Path) -> None:
    cfg = make(tmp_path, gpus=0)
    text = render_slurm_conf(cfg)
    assert "GresTypes" not in text and "Gres=" not in text
    assert cfg.gpu_devices == []
    assert "Name=gpu" not in render_gres_conf(cfg)


def test_invalid_shapes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        make(tmp_path, nodes=0)
    with pytest.raises(ValueError):
        make(tmp_path, gpus=-1)
    with pytest.raises(ValueError):
        make(tmp_path, nodes=300)


def test_fingerprint_changes_with_the_shape(tmp_path: Path) -> None:
    assert fingerprint(make(tmp_path)) == fingerprint(make(tmp_path))
    assert fingerprint(make(tmp_path)) != fingerprint(make(tmp_path, nodes=3))
    assert fingerprint(make(tmp_path)) != fingerprint(make(tmp_path, gpus=0))


def test_state_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HPC_DDP_TESTCLUSTER_DIR", str(tmp_path))
    assert default_state_dir() == tmp_path
    assert ClusterConfig().state_dir == tmp_path
    monkeypatch.delenv("HPC_DDP_TESTCLUSTER_DIR")
    assert default_state_dir() == Path("/tmp/hpc_ddp_testcluster")


def test_hosts_block_is_replaced_idempotently(tmp_path: Path) -> None:
    block = render_hosts_block(make(tmp_path, nodes=2))
    assert block == ["10.77.0.1\tctl", "10.77.0.11\tnode1", "10.77.0.12\tnode2"]
    original = ["127.0.0.1 localhost", "::1 localhost"]
    once = with_block(original, block)
    assert once == [*original, HOSTS_BEGIN, *block, HOSTS_END]
    assert with_block(once, block) == once
    assert with_block(once, block[:1]) == [*original, HOSTS_BEGIN, block[0], HOSTS_END]
    assert strip_block(once) == original
    assert strip_block(original) == original


def test_a_second_instance_shares_nothing_the_machine_holds_once(tmp_path: Path) -> None:
    """Two clusters side by side (the suite's two chains): every name and port differs."""
    first = ClusterConfig(controller_name="ctl")
    second = ClusterConfig(controller_name="ctl", **instance_settings(1))  # type: ignore[arg-type]
    assert second.node_names == ["bnode1", "bnode2", "bnode3", "bnode4"]
    assert second.node_addresses["bnode1"] == "10.78.0.11"
    assert second.state_dir == Path(f"{default_state_dir()}-b")
    names = {
        "state": lambda c: {str(c.state_dir)},
        "bridges": lambda c: {c.bridge, c.fast_bridge},
        "nodes": lambda c: set(c.node_names),
        "addresses": lambda c: set(c.node_addresses.values()) | {c.controller_address},
        "fast": lambda c: set(c.fast_addresses.values()),
        "namespaces": lambda c: {c.netns(n) for n in [*c.node_names, "login"]},
        "veths": lambda c: {v(n) for n in [*c.node_names, "login"]
                            for v in (c.host_veth, c.fast_veth)},
        "database": lambda c: {c.db_name, c.cluster_name},
        "hosts": lambda c: {c.hosts_marker},
    }
    for what, of in names.items():
        assert not of(first) & of(second), what
    # Neither cluster's teardown takes the other's namespaces (network.known_nodes: a prefix).
    assert not second.netns("bnode1").startswith(first.netns(""))
    assert not first.netns("node1").startswith(second.netns(""))
    for cfg in (first, second):
        assert all(len(v) <= 15 for n in [*cfg.node_names, "login"]  # IFNAMSIZ
                   for v in (cfg.host_veth(n), cfg.fast_veth(n)))
    ports = [{line for line in render_slurm_conf(c).splitlines() if "Port=" in line}
             | {line for line in render_slurmdbd_conf(c).splitlines() if "Port=" in line}
             for c in (first, second)]
    assert ports[0] == {"SlurmctldPort=6817", "SlurmdPort=6818", "AccountingStoragePort=6819",
                        "DbdPort=6819"}
    assert ports[1] == {"SlurmctldPort=6827", "SlurmdPort=6828", "AccountingStoragePort=6829",
                        "DbdPort=6829"}
    # The hosts blocks of both live in one /etc/hosts; each cluster replaces only its own.
    both = with_block(with_block(["127.0.0.1 localhost"], render_hosts_block(first),
                                 first.hosts_marker),
                      render_hosts_block(second), second.hosts_marker)
    assert strip_block(both, second.hosts_marker) == with_block(
        ["127.0.0.1 localhost"], render_hosts_block(first), first.hosts_marker)
    assert "10.78.0.11\tbnode1" in strip_block(both, first.hosts_marker)
    with pytest.raises(ValueError, match="instance must be"):
        instance_settings(MAX_INSTANCES)


def prolog_output(cfg: ClusterConfig, **environ: str) -> str:
    script = cfg.state_dir / "task-prolog.sh"
    script.write_text(render_task_prolog(cfg))
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run(["sh", str(script)], env={**env, **environ}, capture_output=True,
                          text=True, check=True).stdout


def test_task_prolog_gives_passive_openmp_threads_and_the_nodes_variables(
        tmp_path: Path) -> None:
    cfg = make(tmp_path)
    assert prolog_output(cfg) == "export OMP_WAIT_POLICY=PASSIVE\n"
    assert prolog_output(cfg, OMP_WAIT_POLICY="ACTIVE") == ""  # the job's own is kept
    cfg.node_env_dir.mkdir(parents=True)
    (cfg.node_env_dir / socket.gethostname()).write_text("export PYTHONPATH=/x\n")
    assert prolog_output(cfg) == "export OMP_WAIT_POLICY=PASSIVE\nexport PYTHONPATH=/x\n"
