"""nccl.apply: the precedence rule (config > exported > detected), every change logged, and
nccl=auto choosing from sysfs trees built in tmp_path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hpc_ddp.config.nccl_schema import NcclConfig
from hpc_ddp.rank.join import nccl, nodeinfo
from hpc_ddp.rank.join.nodeinfo import IbPort, NetIf, NodeInfo
from tests.unit.test_nodeinfo import make_sysfs

AUTO = NcclConfig(profile="auto", detect=True)
IB = "InfiniBand"


def node(*ports: tuple[str, int, str], peermem: str | None = "nvidia_peermem",
         ifaces: tuple[str, ...] = ("lo", "eth0"), layer: str = IB) -> NodeInfo:
    return NodeInfo(ib_ports=tuple(IbPort(h, p, s, layer) for h, p, s in ports),
                    interfaces=tuple(NetIf(n, True) for n in ifaces), peermem=peermem)


@pytest.mark.parametrize("facts, towards, expected", [
    # IB active with peer memory: exact names of the ACTIVE ports only, GDR allowed.
    (node(("mlx5_0", 1, "ACTIVE"), ("mlx5_1", 1, "DOWN"), ("mlx5_10", 1, "ACTIVE")), None,
     {"NCCL_IB_HCA": "=mlx5_0:1,mlx5_10:1", "NCCL_NET_GDR_LEVEL": "PHB"}),
    # No peer memory: no GDR level forced.
    (node(("mlx5_0", 1, "ACTIVE"), peermem=None), "eth0", {"NCCL_IB_HCA": "=mlx5_0:1"}),
    # RoCE ports are verbs ports as well.
    (node(("mlx5_0", 1, "ACTIVE"), layer="Ethernet", peermem=None), None,
     {"NCCL_IB_HCA": "=mlx5_0:1"}),
    # HCAs but every port down: verbs off, sockets on the interface towards rank 0.
    (node(("mlx5_0", 1, "DOWN")), "eth0", {"NCCL_IB_DISABLE": "1",
                                           "NCCL_SOCKET_IFNAME": "=eth0"}),
    # No IB at all, rank 0's interface unknown, one usable interface.
    (node(ifaces=("lo", "docker0", "ens3")), None, {"NCCL_SOCKET_IFNAME": "=ens3"}),
    # Two candidate interfaces and no route known: NCCL's own choice stands.
    (node(ifaces=("lo", "eth0", "eth1")), None, {}),
])
def test_detected_settings(facts: NodeInfo, towards: str | None,
                           expected: dict[str, str]) -> None:
    assert {k: v for k, (v, _) in nccl.derived_env(AUTO, facts, towards).items()} == expected


def test_ib_disabled_by_config_skips_ib_detection() -> None:
    facts = node(("mlx5_0", 1, "ACTIVE"))
    derived = nccl.derived_env(NcclConfig(detect=True, ib_disable=True), facts, "eth0")
    assert {k: v for k, (v, _) in derived.items()} == {"NCCL_SOCKET_IFNAME": "=eth0"}


def test_precedence_config_then_exported_then_detected() -> None:
    cfg = NcclConfig(profile="p", detect=True, ib_timeout=22)
    facts = node(("mlx5_0", 1, "ACTIVE"))
    environ = {"NCCL_IB_TIMEOUT": "18", "NCCL_IB_HCA": "=mlx5_3"}
    changes = {c.name: c for c in nccl.planned_changes(cfg, environ, facts)}
    assert (changes["NCCL_IB_TIMEOUT"].old, changes["NCCL_IB_TIMEOUT"].new) == ("18", "22")
    assert "NCCL_IB_HCA" not in changes          # the site's export beats a guess
    gdr = changes["NCCL_NET_GDR_LEVEL"]
    assert (gdr.source, gdr.new, gdr.reason) == ("detected", "PHB", "nvidia_peermem is loaded")


def test_detection_off_changes_only_the_config(tmp_path: Path) -> None:
    root = make_sysfs(tmp_path, {"mlx5_0:1": "ACTIVE"})
    environ: dict[str, str] = {}
    changes = nccl.apply(NcclConfig(debug="WARN"), environ, root)
    assert environ == {"NCCL_DEBUG": "WARN"} and [c.name for c in changes] == ["NCCL_DEBUG"]


def test_apply_auto_on_a_tree_logs_each_choice(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    root = make_sysfs(tmp_path, {"mlx5_0:1": "ACTIVE", "mlx5_1:1": "DOWN"})
    environ = {"NCCL_DEBUG": "INFO"}
    with caplog.at_level(logging.INFO, logger="hpc_ddp.rank.join.nccl"):
        changes = nccl.apply(AUTO, environ, root)
    assert environ == {"NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "=mlx5_0:1",
                       "NCCL_NET_GDR_LEVEL": "PHB"}
    assert {c.source for c in changes} == {"detected"}
    assert "NCCL_IB_HCA==mlx5_0:1 (detected: ACTIVE ports: mlx5_0:1)" in caplog.text


def test_override_of_an_export_is_logged_with_both_values(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    environ = {"NCCL_SOCKET_IFNAME": "eth1", "NCCL_API_TOKEN": "old"}
    cfg = NcclConfig(profile="site", socket_ifname="=eth0", env={"NCCL_API_TOKEN": "new"})
    with caplog.at_level(logging.INFO, logger="hpc_ddp.rank.join.nccl"):
        nccl.apply(cfg, environ, make_sysfs(tmp_path))
    assert "NCCL_SOCKET_IFNAME==eth0 overrides the exported eth1 (profile site)" in caplog.text
    assert "NCCL_API_TOKEN=**** overrides the exported ****" in caplog.text
    assert "=new" not in caplog.text and "exported old" not in caplog.text


def test_config_warnings_reach_the_rank_log(caplog: pytest.LogCaptureFixture,
                                            tmp_path: Path) -> None:
    with caplog.at_level(logging.WARNING, logger="hpc_ddp.rank.join.nccl"):
        nccl.apply(NcclConfig(env={"NCCL_BLOCKING_WAIT": "1"}), {}, make_sysfs(tmp_path))
    assert "NCCL_BLOCKING_WAIT is deprecated" in caplog.text


@pytest.mark.parametrize("environ, facts, level, words", [
    ({"NCCL_IB_HCA": "mlx5_1"}, node(("mlx5_1", 1, "ACTIVE"), ("mlx5_10", 1, "ACTIVE")),
     nccl.WARN, ["also selects mlx5_10", "=mlx5_1"]),
    ({"NCCL_IB_HCA": "=mlx5_0,mlx5_1"}, node(("mlx5_0", 1, "ACTIVE"), ("mlx5_1", 1, "DOWN")),
     nccl.FAIL, ["not ACTIVE", "mlx5_1:1 DOWN"]),
    ({"NCCL_IB_HCA": "=mlx5_4"}, node(("mlx5_0", 1, "ACTIVE")), nccl.FAIL, ["selects none"]),
    ({"NCCL_SOCKET_IFNAME": "=ib0"}, node(), nccl.FAIL, ["matches no interface", "eth0"]),
    ({"GLOO_SOCKET_IFNAME": "eth"}, node(), nccl.FAIL,
     ["GLOO_SOCKET_IFNAME=eth matches no interface"]),
    ({"NCCL_NET_GDR_LEVEL": "PHB"}, node(("mlx5_0", 1, "ACTIVE"), peermem=None), nccl.WARN,
     ["no peer-memory module"]),
])
def test_node_warnings(environ: dict[str, str], facts: NodeInfo, level: str,
                       words: list[str]) -> None:
    warnings = nccl.node_warnings(environ, facts)
    assert len(warnings) == 1 and warnings[0][0] == level, warnings
    assert all(w in warnings[0][1] for w in words), warnings


def test_node_warnings_quiet_when_all_is_well() -> None:
    facts = node(("mlx5_0", 1, "ACTIVE"), ("mlx5_1", 1, "ACTIVE"))
    environ = {"NCCL_IB_HCA": "=mlx5_0,mlx5_1", "NCCL_SOCKET_IFNAME": "^docker,lo",
               "GLOO_SOCKET_IFNAME": "eth0", "NCCL_NET_GDR_LEVEL": "PHB"}
    assert nccl.node_warnings(environ, facts) == []
    # IB disabled: the HCA list does not matter.
    assert nccl.node_warnings({"NCCL_IB_HCA": "=x", "NCCL_IB_DISABLE": "1"}, facts) == []


def test_root_comes_from_the_environment_per_host(tmp_path: Path) -> None:
    make_sysfs(tmp_path / "nodeA", {"mlx5_0:1": "ACTIVE"}, peermem=None)
    environ = {nodeinfo.SYSFS_ROOT_ENV: str(tmp_path / "{host}")}
    assert nodeinfo.sysfs_root(environ, "nodeA") == tmp_path / "nodeA"
    nccl.apply(AUTO, environ, nodeinfo.sysfs_root(environ, "nodeA"))
    assert environ["NCCL_IB_HCA"] == "=mlx5_0:1" and "NCCL_NET_GDR_LEVEL" not in environ
