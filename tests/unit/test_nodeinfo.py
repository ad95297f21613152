"""Node facts from sysfs trees shaped like real ones (several HCAs, a DOWN port, RoCE, no
peer memory), built in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_ddp.rank.join import nodeinfo
from hpc_ddp.rank.join.nodeinfo import IbPort, NetIf, NodeInfo


def make_sysfs(root: Path, ports: dict[str, str] | None = None, link_layer: str = "InfiniBand",
               peermem: str | None = "nvidia_peermem",
               ifaces: dict[str, str] | None = None) -> Path:
    """A sysfs tree under ``root``: ports {"mlx5_0:1": "ACTIVE"}, interfaces {"ib0": "up"}.

    Real sysfs has class entries as symlinks into /sys/devices; so does this tree.
    """
    devices = root / "sys/devices/pci0000:00"
    for name, state in (ports or {}).items():
        hca, _, port = name.partition(":")
        hca_dir = devices / "infiniband" / hca
        port_dir = hca_dir / "ports" / port
        port_dir.mkdir(parents=True, exist_ok=True)
        code = {"ACTIVE": 4, "DOWN": 1, "INIT": 2, "ARMED": 3}.get(state, 1)
        (port_dir / "state").write_text(f"{code}: {state}\n")
        (port_dir / "link_layer").write_text(f"{link_layer}\n")
        (port_dir / "rate").write_text("200 Gb/sec (4X HDR)\n")
        link = root / "sys/class/infiniband" / hca
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(hca_dir)
    if peermem:
        (root / "sys/module" / peermem / "parameters").mkdir(parents=True, exist_ok=True)
    (root / "sys/module/nvidia").mkdir(parents=True, exist_ok=True)
    for name, state in (ifaces or {"lo": "unknown", "eth0": "up"}).items():
        net = root / "sys/class/net" / name
        net.mkdir(parents=True, exist_ok=True)
        (net / "operstate").write_text(f"{state}\n")
    return root


def test_several_hcas_with_a_down_port(tmp_path: Path) -> None:
    root = make_sysfs(tmp_path, {"mlx5_0:1": "ACTIVE", "mlx5_1:1": "DOWN", "mlx5_10:1": "ACTIVE",
                                 "mlx5_2:1": "ACTIVE"})
    node = nodeinfo.detect(root)
    # Natural order (mlx5_2 before mlx5_10), the state word without its number.
    assert [(p.name, p.state) for p in node.ib_ports] == [
        ("mlx5_0:1", "ACTIVE"), ("mlx5_1:1", "DOWN"), ("mlx5_2:1", "ACTIVE"),
        ("mlx5_10:1", "ACTIVE")]
    assert [p.name for p in node.active_ports] == ["mlx5_0:1", "mlx5_2:1", "mlx5_10:1"]
    assert node.hcas == ["mlx5_0", "mlx5_1", "mlx5_10", "mlx5_2"]
    assert node.peermem == "nvidia_peermem" and not node.roce
    assert node.ib_ports[0].rate.startswith("200 Gb/sec")


def test_roce_no_peermem_and_interfaces(tmp_path: Path) -> None:
    root = make_sysfs(tmp_path, {"mlx5_0:1": "ACTIVE"}, link_layer="Ethernet", peermem=None,
                      ifaces={"lo": "unknown", "docker0": "up", "ens1f0": "up", "eth1": "down"})
    node = nodeinfo.detect(root)
    assert node.roce and node.peermem is None
    assert [i.name for i in node.interfaces] == ["docker0", "ens1f0", "eth1", "lo"]
    assert [i.name for i in node.usable_interfaces()] == ["ens1f0"]


def test_old_peer_memory_module_and_no_infiniband(tmp_path: Path) -> None:
    node = nodeinfo.detect(make_sysfs(tmp_path, peermem="nv_peer_mem"))
    assert node.peermem == "nv_peer_mem" and node.ib_ports == () and node.hcas == []


def test_missing_tree_is_empty_not_an_error(tmp_path: Path) -> None:
    node = nodeinfo.detect(tmp_path / "nothing")
    assert node == NodeInfo(root=str(tmp_path / "nothing"))


def test_real_root_reads_the_live_namespace() -> None:
    node = nodeinfo.detect(Path("/"))
    assert "lo" in [i.name for i in node.interfaces]
    assert any("127.0.0.1" in i.addresses for i in node.interfaces)


@pytest.mark.parametrize("raw, host, expected", [
    ("", "n1", "/"),
    ("/fake/{host}", "node3", "/fake/node3"),
    ("/host", "node3", "/host"),
])
def test_sysfs_root(raw: str, host: str, expected: str) -> None:
    environ = {nodeinfo.SYSFS_ROOT_ENV: raw} if raw else {}
    assert nodeinfo.sysfs_root(environ, host) == Path(expected)


PORTS = ["mlx5_0:1", "mlx5_1:1", "mlx5_1:2", "mlx5_10:1", "mlx5_2:1"]


@pytest.mark.parametrize("spec, expected", [
    ("mlx5", PORTS),                                        # prefix: everything
    ("mlx5_1", ["mlx5_1:1", "mlx5_1:2", "mlx5_10:1"]),      # the prefix trap
    ("=mlx5_1", ["mlx5_1:1", "mlx5_1:2"]),                  # exact
    ("=mlx5_1:2,mlx5_2:1", ["mlx5_1:2", "mlx5_2:1"]),       # exact with ports
    ("^=mlx5_1", ["mlx5_0:1", "mlx5_10:1", "mlx5_2:1"]),    # exclude exact
    ("^mlx5_1", ["mlx5_0:1", "mlx5_2:1"]),                  # exclude prefix (also mlx5_10)
])
def test_nccl_filter_lists(spec: str, expected: list[str]) -> None:
    assert nodeinfo.selected(spec, PORTS) == expected


def test_interface_filters() -> None:
    names = ["docker0", "eth0", "eth1", "ib0", "lo"]
    assert nodeinfo.selected("^docker,lo", names) == ["eth0", "eth1", "ib0"]
    assert nodeinfo.selected("=eth0", names) == ["eth0"]
    assert nodeinfo.selected("ib", names) == ["ib0"]


def test_to_dict_is_json_ready(tmp_path: Path) -> None:
    import json

    node = NodeInfo(ib_ports=(IbPort("mlx5_0", 1, "ACTIVE", "InfiniBand"),),
                    interfaces=(NetIf("eth0", True, ("10.0.0.1",)),), peermem=None)
    data = json.loads(json.dumps(node.to_dict()))
    assert data["ib_ports"][0]["name"] == "mlx5_0:1" and data["interfaces"][0]["up"] is True
