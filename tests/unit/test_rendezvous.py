"""The rendezvous with real stores: O(1) store operations per rank at any world size, a stale
endpoint file never trusted, the missing ranks named once by rank 0, a foreign client unable
to touch the run, rank 0's refusal reported by every rank at once."""

from __future__ import annotations

import functools
import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.rank.join import authstore, checkin, netif, rendezvous
from hpc_ddp.rank.join.distenv import DistEnv


@functools.cache
def _layout(world: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    return tuple(f"node{i + 1}" for i in range(world)), (1,) * world


def env_of(rank: int, world: int, job: str = "7.0") -> DistEnv:
    nodes, tasks = _layout(world)
    return DistEnv(rank, 0, world, rank, world, 1, "slurm", job, nodes=nodes,
                   tasks_on_nodes=tasks)


class Recording:
    """A rank's view of a real in-memory store (torch's HashStore), counting its calls."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return method(*args)
        return counted


@pytest.mark.parametrize("world", [8, 512, 8192])
def test_every_rank_checks_in_with_the_same_few_store_calls_at_any_world_size(
        world: int) -> None:
    import torch.distributed as dist

    shared = dist.HashStore()
    views = [Recording(shared) for _ in range(world)]
    for rank, view in enumerate(views):
        checkin.announce(view, env_of(rank, world), json.dumps({"host": f"node{rank}"}))
    for rank, view in enumerate(views):
        checkin.await_all(view, env_of(rank, world), 1.0)
    # set + add (+ the last one's set) + one wait + the timeout: never a poll per rank
    assert max(v.calls for v in views) == 5 and min(v.calls for v in views) == 4


def _foreign_store() -> authstore.StoreServer:
    """Another run's live store: its own key."""
    return authstore.StoreServer(authstore.new_key(), ["127.0.0.1"])


def _dead_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("stale", ["another run's live store", "a port nobody listens on"])
def test_a_stale_endpoint_file_is_read_again_until_rank_0_publishes(stale: str,
                                                                    tmp_path: Path) -> None:
    # An earlier attempt's file under this attempt's name (job ids that started over): its
    # port is dead, or a store of another run answers there. Rank 1 must wait for rank 0.
    foreign = _foreign_store() if stale.startswith("another") else None
    port = foreign.port if foreign is not None else _dead_port()
    folder = tmp_path / "rendezvous"
    path = rendezvous.endpoint_file(folder, env_of(1, 2))
    old = authstore.new_key()
    rendezvous.publish(path, rendezvous.Endpoint("127.0.0.1", port, old), "node1")
    got: dict[str, Any] = {}

    def rank1() -> None:
        try:
            got["store"], got["endpoint"] = rendezvous.connect(
                env_of(1, 2), folder, "node2", 20, 30)
        except Exception as exc:  # shown by the assertion below
            got["error"] = exc
    joiner = threading.Thread(target=rank1)
    joiner.start()
    joiner.join(1.0)  # rank 1 has read the stale file by now, and must still be waiting
    assert joiner.is_alive(), got
    store, endpoint = rendezvous.connect(env_of(0, 2), folder, "127.0.0.1", 20, 30)
    joiner.join(20)
    assert "error" not in got, got.get("error")
    assert got["endpoint"].port == store.port == endpoint.port != port
    assert got["endpoint"].key == endpoint.key != old


def test_missing_ranks_are_named_by_rank_0_and_reported_by_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkin, "_MASTER_MARGIN_S", 0.5)
    errors: dict[int, str] = {}

    def rank(r: int, host: str) -> None:
        try:
            rendezvous.connect(env_of(r, 3), tmp_path / "rendezvous", host, 1.5, 30)
        except rendezvous.RendezvousError as exc:
            errors[r] = str(exc)
    threads = [threading.Thread(target=rank, args=(r, h))
               for r, h in ((0, "127.0.0.1"), (1, "node2"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = "1 of 3 ranks never joined the rendezvous within 2s: rank(s) 2 (expected on node3)"
    assert errors[0].startswith(expected) and errors[1].startswith(expected), errors


@pytest.mark.parametrize(("name", "addrs", "expected"), [
    ("ib0", [(socket.AF_INET6, "fe80::1%ib0"), (socket.AF_INET, "10.8.0.5")], "10.8.0.5"),
    ("ib0", [(socket.AF_INET6, "fe80::1%ib0"), (socket.AF_INET6, "fd77::b")], "fd77::b"),
    ("ib0", [(socket.AF_INET6, "fe80::1%ib0")], None),  # link-local only: not routable
    ("ib1", [(socket.AF_INET, "10.8.0.5")], None),
])
def test_the_address_rank_0_publishes_for_an_interface(
        name: str, addrs: list[tuple[int, str]], expected: str | None) -> None:
    assert netif.interface_address(name, {"ib0": addrs, "eth0": [(2, "10.0.0.1")]}) == expected


def test_an_interface_rank_0_lacks_is_named_with_those_it_has() -> None:
    with pytest.raises(rendezvous.RendezvousError, match=r"master_interface=nosuch0: rank 0's "
                       r"node node1 has no interface nosuch0 .* \(it has: .*lo 127\.0\.0\.1"):
        rendezvous._master_addr(env_of(0, 2), "node1", "nosuch0")


def test_ipv6_endpoints_print_in_brackets() -> None:
    assert str(rendezvous.Endpoint("fd77::b", 29500)) == "[fd77::b]:29500"
    assert str(rendezvous.Endpoint("node1", 29500)) == "node1:29500"


def test_the_route_towards_an_ipv6_address() -> None:
    assert netif.interface_towards("::1") == "lo"


def test_a_store_every_rank_had_joined_is_not_joined_again() -> None:
    # torchrun's agent store may still name the last attempt's store while its rank 0
    # winds down; a rank of the next attempt must not take it for its own.
    import torch.distributed as dist

    store = dist.HashStore()
    assert all(checkin.announce(store, env_of(r, 2), "{}") for r in (0, 1))
    assert not checkin.announce(store, env_of(1, 2), "{}")
    with pytest.raises(rendezvous.RendezvousError, match="two processes were started as "
                       "the same rank"):
        checkin.check_in(store, env_of(0, 2), "{}", 1.0)


def test_in_podman_only_the_supervisor_has_slurms_signals() -> None:
    from hpc_ddp.rank.join.distenv import step_signals_every_process

    step = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7"}
    assert step_signals_every_process(step)
    assert step_signals_every_process({**step, "HPC_DDP_CONTAINER": "pyxis"})
    assert step_signals_every_process({**step, "HPC_DDP_CONTAINER": "apptainer"})
    assert not step_signals_every_process({**step, "HPC_DDP_CONTAINER": "podman"})
    assert not step_signals_every_process({"SLURM_JOB_ID": "7"})  # a batch or salloc shell
