"""The job's store answers only the run's own ranks (rank/join/authstore.py): a foreign client
that knows host and port (a real torch TCPStore client among them) cannot make the rendezvous
fail or change what it agrees on; the store listens on the published address only; the key
travels in a file only the user can read; rank 0's refusal reaches every rank at once."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from hpc_ddp.rank.join import authstore, checkin, rendezvous, store_client, torch_store
from hpc_ddp.rank.join.distenv import DistEnv


def env_of(rank: int, world: int, source: str = "slurm") -> DistEnv:
    nodes = tuple(f"node{i + 1}" for i in range(world))
    return DistEnv(rank, 0, world, rank, world, 1, source, "7.0", nodes=nodes,
                   tasks_on_nodes=(1,) * world)


def _published(folder: Path, env: DistEnv) -> rendezvous.Endpoint:
    path = rendezvous.endpoint_file(folder, env)
    for _ in range(400):
        found = rendezvous.read_endpoint(path)
        if found is not None:
            return found
        threading.Event().wait(0.05)
    raise AssertionError("rank 0 never published")


def _attack(host: str, port: int) -> list[str]:
    """Everything a client that knows only host and port can try; what it got back."""
    seen = []
    try:  # torch's own client, as anyone on the cluster network has it
        foreign = dist.TCPStore(host, port, 2, False, timedelta(seconds=2),
                                wait_for_workers=False)
        foreign.set("hpc_ddp/all_arrived", "1")
        seen.append(f"set: {foreign.list_keys()}")
    except Exception as exc:
        seen.append(f"TCPStore refused: {type(exc).__name__}")
    held = []
    for payload in (b"\x00" * 64, b"hpc_ddp-store-1\n" + os.urandom(80), b""):
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(payload)
        held.append(s)  # left open: the server drops it after its handshake timeout
    try:
        torch_store.AuthStore(host, port, authstore.new_key(), timedelta(seconds=2))
        seen.append("guessed key accepted")
    except store_client.StoreRefused as exc:
        seen.append(f"wrong key refused: {exc}")
    for s in held:
        s.close()
    return seen


def test_a_foreign_client_cannot_fail_the_rendezvous_or_change_its_outcome(
        tmp_path: Path) -> None:
    folder = tmp_path / "run" / "rendezvous"
    got: dict[int, Any] = {}

    def rank(r: int) -> None:
        try:
            store, _ = rendezvous.connect(env_of(r, 2), folder, "127.0.0.1", 60, 60,
                                          {"host": f"node{r + 1}"})
            got[r] = checkin.placements(store, 2) if r == 0 else store
        except Exception as exc:  # shown by the assertions below
            got[r] = exc

    zero = threading.Thread(target=rank, args=(0,))
    zero.start()
    endpoint = _published(folder, env_of(1, 2))
    seen = _attack("127.0.0.1", endpoint.port)  # while rank 0 waits for rank 1
    assert seen[0] == "TCPStore refused: DistNetworkError", seen
    assert seen[1].startswith("wrong key refused"), seen
    one = threading.Thread(target=rank, args=(1,))
    one.start()
    for t in (zero, one):
        t.join(60)
    assert [r["host"] for r in got[0]] == ["node1", "node2"], got  # as the ranks said
    assert isinstance(got[1], dist.Store), got[1]


def test_the_key_is_in_a_file_only_the_user_can_read(tmp_path: Path) -> None:
    path = rendezvous.endpoint_file(tmp_path / "run" / "rendezvous", env_of(0, 1))
    rendezvous.publish(path, rendezvous.Endpoint("node1", 1234, authstore.new_key()), "node1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    endpoint = rendezvous.read_endpoint(path)
    assert endpoint is not None and endpoint.key not in repr(endpoint) + str(endpoint)
    path.chmod(0o660)  # someone of the group could have swapped in their store
    with pytest.raises(rendezvous.RendezvousError, match="is writable by your group"):
        rendezvous.read_endpoint(path)


def _listening(store: Any) -> set[str]:
    server = getattr(store, "_client", store)._server  # torch_store wraps the plain client
    return {str(s.getsockname()[0]) for s in server._sockets}


def test_the_store_listens_on_the_published_address_only(tmp_path: Path) -> None:
    local, endpoint = rendezvous._serve(env_of(0, 2, "local"), "node1", 30, None)
    assert endpoint.addr == "127.0.0.1" and _listening(local) == {"127.0.0.1"}
    from hpc_ddp.rank.join import netif

    routable = next((a for name, addrs in netif.interfaces().items() if name != "lo"
                     for family, a in addrs if family == socket.AF_INET), None)
    if routable is None:
        pytest.skip("this machine has no address besides loopback")
    name = netif.interface_with_address(routable)
    assert name is not None
    store, endpoint = rendezvous._serve(env_of(0, 2), "node1", 30, name)  # master_interface
    assert endpoint.addr == routable and _listening(store) == {routable}


def test_rank_0s_refusal_ends_every_rank_at_once_with_its_reason(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "rendezvous"
    errors: dict[int, str] = {}

    def rank(r: int) -> None:
        try:  # a rendezvous timeout far longer than this test may take
            rendezvous.connect(env_of(r, 3), folder, f"node{r + 1}", 600, 600,
                               master_interface="nosuch0")
        except rendezvous.RendezvousError as exc:
            errors[r] = str(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), errors
    reason = "cluster.master_interface=nosuch0: rank 0's node node1 has no interface nosuch0"
    assert errors[0].startswith(reason)
    for r in (1, 2):
        assert errors[r].startswith(f"rank 0 refused to start: {reason}"), errors[r]
    published = json.loads(rendezvous.endpoint_file(folder, env_of(1, 3)).read_text())
    assert published["refused"].startswith(reason)


def test_the_store_serves_what_torch_and_hpc_ddp_ask_of_a_store() -> None:
    import torch

    key = authstore.new_key()
    server = authstore.StoreServer(key, ["127.0.0.1"])
    store = torch_store.AuthStore("127.0.0.1", server.port, key, timedelta(seconds=30))
    keys = dist.PrefixStore("p", store)  # as the process group and a supervisor's child use it
    keys.set("a", "1")
    assert store.get("p/a") == b"1" and keys.add("n", 2) == 2 and keys.add("n", 3) == 5
    assert keys.compare_set("c", "", "x") == b"x" and keys.compare_set("c", "y", "z") == b"x"
    assert keys.check(["a", "c"]) and not keys.check(["a", "missing"])
    keys.multi_set(["m1", "m2"], ["v1", "v2"])
    assert keys.multi_get(["m1", "m2"]) == [b"v1", b"v2"] and keys.delete_key("m1")
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        keys.wait(["never"], timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match="refused the request"):
        store.add("p/c", 1)  # not a number: said, not hung
    sums: dict[int, float] = {}

    def rank(r: int) -> None:  # Gloo forms on it and all-reduces (two ranks, one process)
        group = dist.ProcessGroupGloo(dist.PrefixStore("pg", torch_store.AuthStore(
            "127.0.0.1", server.port, key, timedelta(seconds=30))), r, 2, timedelta(seconds=30))
        total = torch.tensor([float(r + 1)])
        group.allreduce([total]).wait()
        sums[r] = total.item()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sums == {0: 3.0, 1: 3.0}


def test_a_supervisor_joins_and_holds_the_store_without_torch(tmp_path: Path) -> None:
    """joined(group=False), as a supervisor joins (issue 36): its modules, the store's
    server and plain client, the software check; torch never imported in that process (the
    cluster's fault-tolerance test checks a live supervisor's memory map too)."""
    code = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from hpc_ddp.config.compose import compose
        from hpc_ddp.rank.join.joined import joined
        from hpc_ddp.rank.supervise import program, script
        from hpc_ddp.rundir import RunDir
        with joined(compose(["cluster=local"]), RunDir(Path({str(tmp_path)!r})),
                    dict(os.environ), group=False) as rank:
            rank.store.set("k", "v")
            assert rank.store.get("k") == b"v" and rank.environment["torch"]
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
