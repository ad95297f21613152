"""The network interface a rank reaches the master through (for Gloo's socket choice)."""

from __future__ import annotations

import socket


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


def addresses() -> dict[str, list[str]]:
    """IPv4 addresses of every interface (recorded per rank in the run dir)."""
    import psutil

    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}
