"""Hostlists expanded like `scontrol show hostnames` (tests/cluster compares with it)."""

from __future__ import annotations

import pytest

from hpc_ddp.hostlist import expand, first_host, tasks_per_node

TABLE = [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("node[7],x[1-3]", ["node7", "x1", "x2", "x3"]),
    ("gpu[009-011],cpu1", ["gpu009", "gpu010", "gpu011", "cpu1"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
]


@pytest.mark.parametrize("nodelist, hosts", TABLE)
def test_expand(nodelist: str, hosts: list[str]) -> None:
    assert expand(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("bad", ["n[3-1]", "n[]", "n[1-2", ""])
def test_malformed_lists_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        expand(bad)


@pytest.mark.parametrize("spec, counts", [("2(x3)", [2, 2, 2]), ("4", [4]),
                                          ("3,1(x2),3", [3, 1, 1, 3])])
def test_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert tasks_per_node(spec) == counts
