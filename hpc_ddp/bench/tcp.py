"""Raw TCP bandwidth between rank 0 and a rank on another node: the physical limit a
socket-based backend (Gloo, NCCL's socket transport) works against.

Rank 0 streams bytes over one plain TCP connection for a few seconds; the receiving rank
counts them from the first byte to the end of the stream. The other ranks wait in a barrier.
"""

from __future__ import annotations

import socket
import time
from typing import Any

CHUNK = 4 * 2**20  # bytes per send/recv call: large enough that syscalls do not dominate


def pick_peer(hosts: list[str]) -> int | None:
    """The first rank on another host than rank 0; rank 1 on a single host; None alone."""
    for rank, host in enumerate(hosts):
        if host != hosts[0]:
            return rank
    return 1 if len(hosts) > 1 else None


def measure(rank: int, hosts: list[str], seconds: float) -> dict[str, Any] | None:
    """Collective over the default group: every rank calls it; rank 0 gets the result."""
    import torch.distributed as dist  # deferred: torch

    peer = pick_peer(hosts)
    if peer is None or seconds <= 0:
        return None
    server: socket.socket | None = None
    offer: Any = None
    if rank == peer:
        from hpc_ddp.rank.join import netif  # deferred (start-up): rank.join.netif

        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind(("0.0.0.0", 0))
        server.listen(1)
        # The address rank 0 reaches us at: ours on the route towards rank 0's host.
        addr = netif.local_address_towards(hosts[0]) or socket.gethostbyname(hosts[rank])
        offer = (addr, server.getsockname()[1])
    offers: list[Any] = [None] * len(hosts)
    dist.all_gather_object(offers, offer)
    result: dict[str, Any] | None = None
    if rank == 0:
        _send(tuple(offers[peer]), seconds)
    elif rank == peer and server is not None:
        received, elapsed = _receive(server)
        result = {"from_host": hosts[0], "to_host": hosts[peer], "to_rank": peer,
                  "address": offer[0], "seconds": elapsed, "bytes": received,
                  "gbps": received / elapsed / 1e9 if elapsed > 0 else 0.0,
                  "same_host": hosts[peer] == hosts[0]}
    results: list[Any] = [None] * len(hosts)
    dist.all_gather_object(results, result)
    return results[peer] if rank == 0 else None


def _send(address: tuple[str, int], seconds: float) -> None:
    payload = bytes(CHUNK)
    with socket.create_connection(address, timeout=30) as conn:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.sendall(payload)


def _receive(server: socket.socket) -> tuple[int, float]:
    """(bytes, seconds) counted from the first chunk on: connection set-up is not bandwidth."""
    server.settimeout(60)
    conn, _ = server.accept()
    view = memoryview(bytearray(CHUNK))
    with conn, server:
        if conn.recv_into(view) == 0:
            return 0, 0.0
        started = time.perf_counter()
        received = 0
        while n := conn.recv_into(view):
            received += n
        return received, time.perf_counter() - started
