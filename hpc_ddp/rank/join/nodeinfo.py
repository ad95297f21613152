"""What a node offers for communication: IB/RoCE ports, interfaces, GPUDirect, GPUs.

Everything is read from a root path (``/`` on a real node), so tests feed sysfs trees shaped
like real ones. The layout read (Linux sysfs, as the RDMA and module subsystems publish it):

    <root>/sys/class/infiniband/<hca>/ports/<n>/state        "4: ACTIVE", "1: DOWN"
    <root>/sys/class/infiniband/<hca>/ports/<n>/link_layer   "InfiniBand" or "Ethernet" (RoCE)
    <root>/sys/class/infiniband/<hca>/ports/<n>/rate         "200 Gb/sec (4X HDR)"
    <root>/sys/module/nvidia_peermem (or nv_peer_mem)          GPUDirect RDMA peer memory loaded
    <root>/sys/class/net/<if>/operstate                      "up", "down", "unknown"

``HPC_DDP_SYSFS_ROOT`` moves the root (for containers that mount the host's /sys elsewhere,
and for tests); ``{host}`` in it is replaced by the node's host name, so that every node of a
test cluster can read a tree of its own.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SYSFS_ROOT_ENV = "HPC_DDP_SYSFS_ROOT"
# GPUDirect RDMA through peer memory: nvidia_peermem (driver >= 465), nv_peer_mem before.
# https://docs.nvidia.com/cuda/gpudirect-rdma/ ; NCCL troubleshooting "GPU Direct".
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
# Interfaces NCCL itself skips unless nothing else exists (NCCL_SOCKET_IFNAME docs), plus
# the host ends of container/VM bridges.
SKIPPED_IFACES = ("lo", "docker", "virbr", "veth")


@dataclass(frozen=True)
class IbPort:
    hca: str
    port: int
    # ACTIVE, DOWN, INIT, ARMED, ... (the word after "N: " in the state file)
    state: str
    # InfiniBand or Ethernet (RoCE)
    link_layer: str
    rate: str = ""

    @property
    def name(self) -> str:
        return f"{self.hca}:{self.port}"

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class NetIf:
    name: str
    up: bool
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeInfo:
    ib_ports: tuple[IbPort, ...] = ()
    interfaces: tuple[NetIf, ...] = ()
    # The loaded peer-memory module's name, None when none is loaded.
    peermem: str | None = None
    # GPU names as torch sees them (None: not asked).
    gpus: tuple[str, ...] | None = None
    root: str = "/"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def hcas(self) -> list[str]:
        return sorted({p.hca for p in self.ib_ports})

    @property
    def active_ports(self) -> list[IbPort]:
        return [p for p in self.ib_ports if p.active]

    @property
    def roce(self) -> bool:
        return any(p.link_layer == "Ethernet" for p in self.active_ports)

    def usable_interfaces(self) -> list[NetIf]:
        """Up interfaces that are not loopback or container/VM plumbing."""
        return [i for i in self.interfaces
                if i.up and not i.name.startswith(SKIPPED_IFACES)]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ib_ports"] = [{**asdict(p), "name": p.name} for p in self.ib_ports]
        return data


def sysfs_root(environ: Mapping[str, str], host: str | None = None) -> Path:
    """The root node facts are read from: ``$HPC_DDP_SYSFS_ROOT`` ({host} filled in) or /."""
    raw = environ.get(SYSFS_ROOT_ENV, "")
    if not raw:
        return Path("/")
    return Path(raw.replace("{host}", host or socket.gethostname()))


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def ib_ports(root: Path) -> list[IbPort]:
    """Every port of every RDMA device under ``root`` (sorted by HCA name, then port)."""
    base = root / "sys/class/infiniband"
    if not base.is_dir():
        return []
    ports: list[IbPort] = []
    for hca in sorted(base.iterdir(), key=lambda p: _natural(p.name)):
        port_dir = hca / "ports"
        if not port_dir.is_dir():
            continue
        for port in sorted(port_dir.iterdir(), key=lambda p: _natural(p.name)):
            if not port.name.isdigit():
                continue
            state = _read(port / "state")
            ports.append(IbPort(hca.name, int(port.name),
                                state.split(":", 1)[-1].strip() or "UNKNOWN",
                                _read(port / "link_layer") or "InfiniBand",
                                _read(port / "rate")))
    return ports


def _natural(name: str) -> tuple[Any, ...]:
    """mlx5_2 before mlx5_10."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return (head, int(tail) if tail else -1)


def peer_memory_module(root: Path) -> str | None:
    for name in PEERMEM_MODULES:
        if (root / "sys/module" / name).is_dir():
            return name
    return None


def sysfs_interfaces(root: Path) -> list[NetIf]:
    """Interfaces from ``<root>/sys/class/net`` (operstate "up"; "unknown" counts as up, as
    for tunnels and some virtual NICs that do not report carrier)."""
    base = root / "sys/class/net"
    if not base.is_dir():
        return []
    return [NetIf(p.name, _read(p / "operstate") in ("up", "unknown"))
            for p in sorted(base.iterdir(), key=lambda p: _natural(p.name))]


def live_interfaces() -> list[NetIf]:
    """This process's network namespace as the kernel reports it (psutil). /sys/class/net
    would show the namespace that mounted /sys, which differs inside `nsenter --net` nodes."""
    import psutil  # deferred: psutil

    stats = psutil.net_if_stats()
    addrs = psutil.net_if_addrs()
    return [NetIf(name, bool(stats[name].isup),
                  tuple(a.address for a in addrs.get(name, []) if a.family == socket.AF_INET))
            for name in sorted(stats, key=_natural)]


def gpu_names() -> tuple[str, ...]:
    """Names of the CUDA devices this process sees (empty without CUDA)."""
    import torch  # deferred: torch

    if not torch.cuda.is_available():
        return ()
    return tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def detect(root: Path = Path("/"), with_gpus: bool = False) -> NodeInfo:
    """The node's facts read under ``root``; interfaces come from the live namespace when
    ``root`` is the real /, from the tree otherwise."""
    real = root.resolve() == Path("/")
    return NodeInfo(ib_ports=tuple(ib_ports(root)),
                    interfaces=tuple(live_interfaces() if real else sysfs_interfaces(root)),
                    peermem=peer_memory_module(root),
                    gpus=gpu_names() if with_gpus else None, root=str(root))


def selected(spec: str, names: list[str]) -> list[str]:
    """The names an NCCL filter list selects (NCCL_SOCKET_IFNAME, NCCL_IB_HCA): comma items,
    leading `^` excludes, then `=` exact names, prefixes otherwise; `:port` suffixes are
    compared when the name carries one. https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-ib-hca
    """
    exclude = spec.startswith("^")
    body = spec.removeprefix("^")
    exact = body.startswith("=")
    tokens = [t for t in body.removeprefix("=").split(",") if t]

    def matches(name: str, token: str) -> bool:
        want, _, port = token.partition(":")
        have, _, have_port = name.partition(":")
        if port and have_port and port != have_port:
            return False
        return have == want if exact else have.startswith(want)

    return [n for n in names if any(matches(n, t) for t in tokens) != exclude]
