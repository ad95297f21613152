"""The network interface a rank reaches the master through (for Gloo's socket choice)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence


def local_address_towards(addr: str) -> str | None:
    """The local IP the kernel would use to reach ``addr`` (no packet is sent)."""
    try:
        target = socket.gethostbyname(addr)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # UDP connect only picks a route
            return str(probe.getsockname()[0])
    except OSError:
        return None


def interface_with_address(ip: str) -> str | None:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return str(name)
    return None


def interface_towards(addr: str) -> str | None:
    """Name of the interface that routes to ``addr`` (e.g. eth0, ib0, lo), or None."""
    ip = local_address_towards(addr)
    return interface_with_address(ip) if ip else None


def gloo_interface(master: str, host: str, step_hosts: Sequence[str],
                   towards: Callable[[str], str | None] = interface_towards) -> str | None:
    """The interface Gloo should use on this rank: the one the kernel routes rank 0's address
    ``master`` through. Where that is loopback while the step spans other hosts (rank 0 is on
    this node, or this node's name resolves to 127.0.1.1 as Debian's /etc/hosts has it), a
    loopback socket would be unreachable from them: the interface towards another host of the
    step instead, else None (Gloo's own choice)."""
    iface = towards(master)
    others = [h for h in dict.fromkeys(step_hosts) if h != host]
    if iface is not None and iface.startswith("lo") and others:
        iface = towards(others[0])
        return None if iface is None or iface.startswith("lo") else iface
    return iface


def addresses() -> dict[str, list[str]]:
    """IPv4 addresses of every interface (recorded per rank in the run dir)."""
    import psutil

    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}
