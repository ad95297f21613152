"""Which interface Gloo binds on a rank: a table of routes (what the kernel would answer)."""

from __future__ import annotations

import pytest

from hpc_ddp.rank.join.netif import gloo_interface

# name -> the interface the kernel routes it through, on the node asking
ROUTES = {"node1": "eth0", "node2": "eth0", "127.0.0.1": "lo", "ib-node1": "ib0"}


@pytest.mark.parametrize("master, host, step_hosts, routes, expected", [
    # a rank on another node: towards rank 0's published name
    ("node1", "node2", ["node1", "node2"], ROUTES, "eth0"),
    # rank 0's node, whose own name resolves to 127.0.1.1 (Debian): towards another host
    ("node1", "node1", ["node1", "node2"], {**ROUTES, "node1": "lo"}, "eth0"),
    # a one-node step: loopback is right
    ("node1", "node1", ["node1"], {**ROUTES, "node1": "lo"}, "lo"),
    # a local run (no Slurm hosts) on loopback
    ("127.0.0.1", "box", [], ROUTES, "lo"),
    # only loopback anywhere on a multi-host step: leave it to Gloo
    ("node1", "node1", ["node1", "node2"], {"node1": "lo", "node2": "lo"}, None),
    # the name does not resolve here: nothing to say
    ("elsewhere", "node2", ["node1", "node2"], ROUTES, None),
    # a master_interface address on InfiniBand
    ("ib-node1", "node2", ["node1", "node2"], ROUTES, "ib0"),
])
def test_gloo_interface(master: str, host: str, step_hosts: list[str], routes: dict[str, str],
                        expected: str | None) -> None:
    assert gloo_interface(master, host, step_hosts, towards=routes.get) == expected
