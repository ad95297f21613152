"""Network interfaces of a rank: the one it reaches the master through (for Gloo's socket
choice), and the address rank 0 publishes when cluster.master_interface names one. IPv4 and
IPv6 alike."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping, Sequence

_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def local_address_towards(addr: str) -> str | None:
    """The local IP the kernel would use to reach ``addr`` (no packet is sent)."""
    try:
        family, _, _, _, target = socket.getaddrinfo(addr, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)  # UDP connect only picks a route
            return str(probe.getsockname()[0])
    except (OSError, IndexError):
        return None


def _same_ip(a: str, b: str) -> bool:
    try:  # link-local IPv6 addresses carry a %scope suffix
        return ipaddress.ip_address(a.split("%")[0]) == ipaddress.ip_address(b.split("%")[0])
    except ValueError:
        return False


def interface_with_address(ip: str) -> str | None:
    import psutil  # deferred: psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family in _FAMILIES and _same_ip(a.address, ip) for a in addrs):
            return str(name)
    return None


def interface_address(name: str, interfaces: Mapping[str, Sequence[tuple[int, str]]]
                      ) -> str | None:
    """The address to publish for interface ``name`` (pure; ``interfaces``: name -> (family,
    address) as psutil lists them): its first IPv4 address, else its first global IPv6 one
    (a link-local address is reachable only with a scope, which other nodes do not share)."""
    addrs = interfaces.get(name, ())
    for family, address in addrs:
        if family == socket.AF_INET:
            return address
    for family, address in addrs:
        if family == socket.AF_INET6 and not ipaddress.ip_address(
                address.split("%")[0]).is_link_local:
            return address.split("%")[0]
    return None


def interfaces() -> dict[str, list[tuple[int, str]]]:
    """name -> [(family, address)] of this machine's IPv4 and IPv6 addresses."""
    import psutil  # deferred: psutil

    return {name: [(int(a.family), str(a.address)) for a in addrs if a.family in _FAMILIES]
            for name, addrs in psutil.net_if_addrs().items()}


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
    """IPv4 and IPv6 addresses of every interface (recorded per rank in the run dir)."""
    return {name: [address for _, address in found] for name, found in interfaces().items()}
