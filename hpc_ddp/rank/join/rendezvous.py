"""A rendezvous that cannot collide, cannot hang silently, and answers only its own ranks.

Every peer tool derives MASTER_PORT from the job id, and two jobs sharing a node can collide.
Here rank 0 asks the kernel for a free port (its store bound to port 0) and publishes address,
port and the attempt's store key in the run directory, keyed by job, step and restart, in a
file only the user can read (mode 600); the other ranks read it from there (the run directory
is on a shared filesystem, as submitit already requires). The store (authstore.py) listens
on the published address only (loopback for a run on one machine) and serves only a peer
that proves it knows the key. A MASTER_PORT set by the user wins. Then every rank checks in;
if some never do within the timeout, the job fails naming those ranks and the hosts they
should have run on. Rank 0 that cannot serve at all (cluster.master_interface missing on its
node) publishes why instead, and every rank stops at once with its reason.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from hpc_ddp.owned import Untrusted, read_owned
from hpc_ddp.rank.join.checkin import RendezvousError, announce, await_all, check_in
from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.rundir import write_text

T = TypeVar("T")

log = logging.getLogger(__name__)

# Waits for the endpoint file start short and back off to this: a rank's reads of the shared
# file system stay O(1) per second however many ranks wait. For the first _EARLY_S seconds,
# when rank 0's endpoint normally appears (every rank of a node starts within a second of the
# others: rank/warm/), a pause is at most _EARLY_POLL_S: a rank sees it at most that late.
_FIRST_POLL_S = 0.05
_EARLY_POLL_S = 0.2
_EARLY_S = 15.0
_MAX_POLL_S = 2.0


@dataclass(frozen=True)
class Endpoint:
    addr: str
    port: int
    # This attempt's store key (authstore.py): what a peer proves it knows. In the endpoint
    # file (mode 600) and a supervisor's child's environment only; never logged (repr=False).
    key: str = field(default="", repr=False)

    def __str__(self) -> str:
        return f"[{self.addr}]:{self.port}" if ":" in self.addr else f"{self.addr}:{self.port}"


def endpoint_file(folder: Path, env: DistEnv) -> Path:
    # One file per job, step and restart: an earlier attempt's file is not meant to be read
    # (and the nonce catches one that is, e.g. after a cluster's job ids started over).
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in env.job_id)
    return folder / f"{safe}-r{env.restart}.json"


def publish(path: Path, endpoint: Endpoint, host: str) -> None:
    """Write the endpoint atomically (temp file + rename, so a reader never sees half),
    readable by the user alone: it holds the store's key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps({"addr": endpoint.addr, "port": endpoint.port, "host": host,
                                 "key": endpoint.key}), private=True)


def publish_refusal(path: Path, message: str) -> None:
    """Rank 0 cannot serve the rendezvous: why, where the others look for its address."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps({"refused": message}), private=True)


def read_endpoint(path: Path) -> Endpoint | None:
    """The published endpoint, or None while there is none. RendezvousError at once when
    rank 0 published its refusal, or when the file is someone else's or others could have
    written it (hpc_ddp/owned.py: a planted endpoint would hand the ranks another store). The
    run dir and each folder down are opened in turn, which makes an NFS client revalidate
    them (close-to-open): a file another node created since this client last looked is seen
    at once, not after the attribute cache expires; no listing."""
    try:
        data = json.loads(read_owned(path, path.parent.parent))
    except Untrusted as exc:
        raise RendezvousError(f"the rendezvous file is refused: {exc}") from None
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("refused"):
        raise RendezvousError(f"rank 0 refused to start: {data['refused']}")
    try:
        return Endpoint(str(data["addr"]), int(data["port"]), str(data.get("key", "")))
    except (KeyError, TypeError, ValueError):
        return None


def _backoff(previous: float, waited: float = 0.0) -> float:
    return min(_EARLY_POLL_S if waited < _EARLY_S else _MAX_POLL_S, previous * 1.5)


def _until(deadline: float, attempt: Callable[[], T | None]) -> T | None:
    """``attempt()`` until it gives something or ``deadline`` (time.monotonic) has passed,
    backing off from _FIRST_POLL_S to _MAX_POLL_S between tries (a rank never hammers the
    file system or rank 0's store); None if it never did. Tries at least once."""
    pause, began = _FIRST_POLL_S, time.monotonic()
    while True:
        found = attempt()
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = _backoff(pause, time.monotonic() - began)


def connect(env: DistEnv, folder: Path, host: str, timeout_s: float,
            collective_timeout_s: float, record: dict[str, Any] | None = None,
            agent_store: str | None = None, master_interface: str | None = None,
            store_key: str | None = None, plain: bool = False) -> tuple[Any, Endpoint]:
    """Form the store every rank shares; returns it (a torch.distributed Store: authstore's
    client as torch_store.py wraps it; ``plain``: the plain client, for a process that makes
    no process group and imports no torch, a supervisor) and its address. ``record``: this
    rank's placement (host, GPU), which rank 0 can read back with checkin.placements (the
    summary's rank -> node -> GPU map).
    ``master_interface``: rank 0 publishes that interface's address instead of its host name
    (cluster.master_interface).

    ``agent_store``: a process above the ranks already holds a store at MASTER_ADDR and
    MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE). "supervisor": hpc_ddp's own, new for every
    attempt, whose key the supervisor hands its child (``store_key``): every rank is its
    client, keys under a prefix of their own. "torchrun": its agent's store (torchrun's own
    TCPStore) outlives torchrun's restarts (the c10d rendezvous keeps it), so an earlier
    attempt's check-ins are still there, and TORCHELASTIC_RESTART_COUNT differs between
    nodes (it counts failures only, not restarts for a changed membership); rank 0 then makes
    a fresh store, names it on the agent's store and puts its key in the run dir, and a rank
    that finds a named store it cannot reach (the last attempt's, whose processes torchrun
    stopped) reads again.

    Every rank does O(1) store operations and file reads, whatever the world size: no rank
    polls the store (the check-in ends with one blocking wait), and the endpoint file is read
    with a backoff. Raises RendezvousError naming the ranks (and their expected hosts) that
    never arrived, or rank 0's reason when it refused to serve.
    """
    mine = json.dumps(record or {"host": host})
    if agent_store == "supervisor" and env.master_addr and env.master_port:
        import torch.distributed as dist  # deferred: torch (a supervisor's child has it)

        endpoint = Endpoint(env.master_addr, env.master_port, store_key or "")
        store: Any = dist.PrefixStore(attempt_prefix(env.restart, env.generation), _client_store(
            env, endpoint, timeout_s, collective_timeout_s))
        check_in(store, env, mine, timeout_s)
        return store, endpoint
    if agent_store and env.master_addr and env.master_port:
        import torch.distributed as dist  # deferred: torch (torchrun's agent store)

        agent = dist.TCPStore(env.master_addr, env.master_port, None, False,
                              timedelta(seconds=timeout_s), wait_for_workers=False)
        store, endpoint = _fresh_store(env, agent, folder, host, timeout_s,
                                       collective_timeout_s, master_interface, mine)
        await_all(store, env, timeout_s)
        return store, endpoint
    if env.is_master:
        path = endpoint_file(folder, env)
        try:
            store, endpoint = _serve(env, host, collective_timeout_s, master_interface,
                                     env.master_port or 0, plain)
        except RendezvousError as exc:  # every rank stops now, with this reason
            publish_refusal(path, str(exc))
            raise
        publish(path, endpoint, host)
        log.info("rendezvous: rank 0 listens on %s (published in %s)", endpoint, path)
    else:
        store, endpoint = _join_published(env, endpoint_file(folder, env), timeout_s,
                                          collective_timeout_s, plain)
    check_in(store, env, mine, timeout_s)
    return store, endpoint


def _serve(env: DistEnv, host: str, collective_timeout_s: float,
           master_interface: str | None, port: int = 0,
           plain: bool = False) -> tuple[Any, Endpoint]:
    """Rank 0's store, with a fresh key, on a port the kernel hands out (port 0: no formula
    can collide; else a MASTER_PORT the user set), listening on the published address."""
    # deferred (start-up): rank.join.authstore
    from hpc_ddp.rank.join import authstore

    addr = _master_addr(env, host, master_interface)
    hosts = listen_addresses(env, addr)
    if not hosts:
        log.info("rendezvous: %s resolves here to none of this node's addresses but loopback; "
                 "the store listens on every interface (it lets in only this run's ranks)",
                 addr)
    key = authstore.new_key()
    server = authstore.StoreServer(key, hosts, port)
    own = hosts[0] if hosts else "127.0.0.1"
    store = new_client(own, server.port, key, timedelta(seconds=collective_timeout_s),
                       server=server, plain=plain)
    return store, Endpoint(addr, server.port, key)


def new_client(host: str, port: int, key: str, timeout: timedelta,
               connect_timeout_s: float = 10.0, server: Any = None, plain: bool = False) -> Any:
    """A client of the store at ``host:port``: torch_store's (a torch.distributed.Store), or
    with ``plain`` store_client's own, whose process need not import torch."""
    if plain:
        # deferred (start-up): rank.join.store_client
        from hpc_ddp.rank.join.store_client import StoreClient

        return StoreClient(host, port, key, timeout, connect_timeout_s, server)
    from hpc_ddp.rank.join.torch_store import AuthStore  # deferred: torch

    return AuthStore(host, port, key, timeout, connect_timeout_s, server)


def listen_addresses(env: DistEnv, addr: str) -> list[str]:
    """Where rank 0's store listens: loopback for a run on one machine; else the addresses
    of this node that ``addr`` (what rank 0 publishes) resolves to here; none (every
    interface) where it resolves to none of them (a name mapped to 127.0.1.1, a MASTER_ADDR
    of another host): the key still keeps everyone else out."""
    if env.source in ("local", "single"):
        return ["127.0.0.1"]
    # deferred (start-up): rank.join.netif
    from hpc_ddp.rank.join import netif

    try:
        found = {info[4][0] for info in socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)}
    except OSError:
        return []
    own = {a for addrs in netif.interfaces().values() for _, a in addrs}
    return sorted(a for a in found if a in own and not ipaddress.ip_address(a).is_loopback)


def _join_published(env: DistEnv, path: Path, timeout_s: float,
                    collective_timeout_s: float, plain: bool = False) -> tuple[Any, Endpoint]:
    """A client: read rank 0's endpoint (backing off), reach it, prove it knows the key; a
    file that leads nowhere or to another store is read again until the timeout. A
    MASTER_ADDR or MASTER_PORT the user set is where the store is (rank 0 publishes them)."""
    deadline = time.monotonic() + timeout_s
    seen: Endpoint | None = None
    last = "no endpoint file yet"

    def attempt() -> tuple[Any, Endpoint] | None:
        nonlocal seen, last
        published = read_endpoint(path)
        if published is None:
            return None
        seen = endpoint = Endpoint(env.master_addr or published.addr,
                                   env.master_port or published.port, published.key)
        store, last = _try_store(env, endpoint, deadline, collective_timeout_s, plain)
        return (store, endpoint) if store is not None else None

    found = _until(deadline, attempt)
    if found is not None:
        return found
    where = env.expected_host(0) or "its node"
    if seen is None:
        raise RendezvousError(
            f"rank {env.rank} waited {timeout_s:.0f}s for rank 0 (on {where}) to publish its "
            f"address in {path}, but it never did: rank 0 did not start or cannot write "
            "there. Check rank 0's log, and that run_dir is on a filesystem every node shares.")
    raise RendezvousError(
        f"rank {env.rank} could not reach rank 0 at {seen} within {timeout_s:.0f}s ({last}). "
        f"Check that {seen.addr} resolves and is reachable from this node, and MASTER_ADDR "
        "or cluster.master_interface if you set one.")


def _try_store(env: DistEnv, endpoint: Endpoint, deadline: float,
               collective_timeout_s: float, plain: bool = False) -> tuple[Any | None, str]:
    """(the store at ``endpoint`` if it is this attempt's, else None and why not)."""
    try:
        store = new_client(endpoint.addr, endpoint.port, endpoint.key,
                           timedelta(seconds=collective_timeout_s),
                           max(2.0, min(10.0, deadline - time.monotonic())), plain=plain)
    except (OSError, ValueError, RuntimeError) as exc:  # refused, unresolvable, not ours
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return store, ""


_AGENT_KEY = "hpc_ddp/endpoint"


def _fresh_store(env: DistEnv, agent: Any, folder: Path, host: str, timeout_s: float,
                 collective_timeout_s: float, master_interface: str | None,
                 record: str) -> tuple[Any, Endpoint]:
    """This attempt's own store, named on torchrun's agent store (see connect) by a random
    name whose endpoint file (with the key) is in the run dir, and this rank announced in it.
    The agent's key may still name the last attempt's store, alive while its rank 0 winds
    down: a store every rank of an attempt has arrived in already is that one (this rank
    would be one too many), and the key is read again until it changes."""
    if env.is_master:
        # Its own address: torchrun's MASTER_ADDR is the agent store's host (the rendezvous
        # endpoint), which need not be the node rank 0 runs on.
        name = uuid.uuid4().hex
        try:
            store, endpoint = _serve(dataclasses.replace(env, master_addr=None), host,
                                     collective_timeout_s, master_interface)
        except RendezvousError as exc:
            agent.set(_AGENT_KEY, json.dumps({"refused": str(exc)}))
            raise
        announce(store, env, record)
        publish(folder / f"torchrun-{name}.json", endpoint, host)
        agent.set(_AGENT_KEY, json.dumps({"name": name}))
        return store, endpoint
    deadline = time.monotonic() + timeout_s
    finished: set[bytes] = set()
    why = ""
    named: Endpoint | None = None  # the store the agent's key names

    def attempt() -> tuple[Any, Endpoint] | None:
        nonlocal why, named
        raw = bytes(agent.get(_AGENT_KEY))  # waits until it is set
        if raw in finished:
            return None
        data = json.loads(raw.decode())
        if data.get("refused"):
            raise RendezvousError(f"rank 0 refused to start: {data['refused']}")
        named = read_endpoint(folder / f"torchrun-{data.get('name', '')}.json")
        if named is None:  # not on this node's view of the shared file system yet
            return None
        store, why = _try_store(env, named, deadline, collective_timeout_s)
        if store is None:
            return None
        if announce(store, env, record):
            return store, named
        finished.add(raw)
        why = "only the last attempt's store, which every rank had joined"
        return None

    found = _until(deadline, attempt)
    if found is None:
        raise RendezvousError(
            f"rank {env.rank} found rank 0's store at {named} on torchrun's store but "
            f"could not reach it within {timeout_s:.0f}s ({why}).")
    return found


def attempt_prefix(restart: int, generation: int = 0) -> str:
    """The store prefix of an attempt's keys under an agent's store: one per requeue
    (``restart``) and per start in place within it (``generation``), so a restarted start
    never meets an earlier one's keys."""
    return f"hpc_ddp_attempt/{restart}/" if not generation else (
        f"hpc_ddp_attempt/{restart}.{generation}/")


def prefixed(prefix: str, key: str) -> str:
    """The key a ``torch.distributed.PrefixStore(prefix, store)`` keeps ``key`` under in
    ``store`` (torch's PrefixStore::joinKey), for a client that asks the store itself."""
    return f"{prefix}/{key}"


def _master_addr(env: DistEnv, host: str, master_interface: str | None = None) -> str:
    """What rank 0 publishes: a MASTER_ADDR the environment gives; else the address of
    cluster.master_interface (e.g. ib0, where host names resolve to a slow management
    network); else its host name (loopback for a run on one machine)."""
    if env.master_addr:
        return env.master_addr
    if env.source in ("local", "single"):
        return "127.0.0.1"
    if master_interface:
        # deferred (start-up): rank.join.netif
        from hpc_ddp.rank.join import netif

        found = netif.interfaces()
        addr = netif.interface_address(master_interface, found)
        if addr is None:
            have = ", ".join(f"{name} {' '.join(a for _, a in addrs)}"
                             for name, addrs in sorted(found.items()) if addrs)
            raise RendezvousError(
                f"cluster.master_interface={master_interface}: rank 0's node {host} has no "
                f"interface {master_interface} with a routable address (it has: {have}). "
                "Name one of those, or leave cluster.master_interface unset (the host name).")
        return addr
    return host


def _client_store(env: DistEnv, endpoint: Endpoint, timeout_s: float,
                  collective_timeout_s: float) -> Any:
    """A client of the store at a known address (a supervisor's, for its child): reached
    with a backoff until the timeout."""
    deadline = time.monotonic() + timeout_s
    why = ""

    def attempt() -> Any:
        nonlocal why
        store, why = _try_store(env, endpoint, deadline, collective_timeout_s)
        return store

    store = _until(deadline, attempt)
    if store is None:
        raise RendezvousError(
            f"rank {env.rank} could not reach rank 0 at {endpoint} within "
            f"{timeout_s:.0f}s ({why or 'no answer'}). Check that {endpoint.addr} "
            "resolves and is reachable from this node, and MASTER_ADDR if you set it.")
    return store


def client(endpoint: Endpoint, timeout_s: float, plain: bool = True) -> Any:
    """Another connection to the store at ``endpoint`` (a thread's own, e.g. a supervisor's
    stack relay: a store client serves one request at a time): plain (no torch), or a
    torch.distributed.Store for a process group (``plain`` false: a script's, job_store.py)."""
    return new_client(endpoint.addr, endpoint.port, endpoint.key,
                      timedelta(seconds=timeout_s), plain=plain)
