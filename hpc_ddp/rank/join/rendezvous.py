"""A rendezvous that cannot collide and cannot hang silently.

Every peer tool derives MASTER_PORT from the job id, and two jobs sharing a node can collide.
Here rank 0 asks the kernel for a free port (a TCPStore bound to port 0), and publishes
address and port in the run directory, keyed by job, step and restart; the other ranks read
it from there (the run directory is on a shared filesystem, as submitit already requires).
A MASTER_PORT set by the user wins. Then every rank checks in; if some never do within the
timeout, the job fails naming those ranks and the hosts they should have run on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.rundir import write_text

T = TypeVar("T")

log = logging.getLogger(__name__)

# Waits for the endpoint file start short and back off to this: a rank's reads of the shared
# file system stay O(1) per second however many ranks wait.
_FIRST_POLL_S = 0.05
_MAX_POLL_S = 2.0
_MASTER_MARGIN_S = 10.0
_NONCE_KEY = "hpc_ddp/nonce"
_ARRIVED = "hpc_ddp/arrived"
_ALL_ARRIVED = "hpc_ddp/all_arrived"
_MISSING = "hpc_ddp/missing"


class RendezvousError(RuntimeError):
    """The ranks could not meet; the message names who is missing and where."""


@dataclass(frozen=True)
class Endpoint:
    addr: str
    port: int
    # Rank 0's random token for this attempt, also in its store: a client that reaches a
    # store without it has read a stale file (an earlier attempt's, a port since reused).
    nonce: str = ""

    def __str__(self) -> str:
        return f"[{self.addr}]:{self.port}" if ":" in self.addr else f"{self.addr}:{self.port}"


def endpoint_file(folder: Path, env: DistEnv) -> Path:
    # One file per job, step and restart: an earlier attempt's file is not meant to be read
    # (and the nonce catches one that is, e.g. after a cluster's job ids started over).
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in env.job_id)
    return folder / f"{safe}-r{env.restart}.json"


def publish(path: Path, endpoint: Endpoint, host: str) -> None:
    """Write the endpoint atomically (temp file + rename), so a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps({"addr": endpoint.addr, "port": endpoint.port, "host": host,
                                 "nonce": endpoint.nonce}))


def read_endpoint(path: Path) -> Endpoint | None:
    """The published endpoint, or None while there is none. Opening the folder first makes an
    NFS client revalidate it (close-to-open), so a file another node created since this
    client last looked is seen at once, not after the attribute cache expires; no listing."""
    try:
        os.close(os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY))
        data = json.loads(path.read_text())
        return Endpoint(str(data["addr"]), int(data["port"]), str(data.get("nonce", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _backoff(previous: float) -> float:
    return min(_MAX_POLL_S, previous * 1.5)


def _until(deadline: float, attempt: Callable[[], T | None]) -> T | None:
    """``attempt()`` until it gives something or ``deadline`` (time.monotonic) has passed,
    backing off from _FIRST_POLL_S to _MAX_POLL_S between tries (a rank never hammers the
    file system or rank 0's store); None if it never did. Tries at least once."""
    pause = _FIRST_POLL_S
    while True:
        found = attempt()
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = _backoff(pause)


def connect(env: DistEnv, folder: Path, host: str, timeout_s: float,
            collective_timeout_s: float, record: dict[str, Any] | None = None,
            agent_store: str | None = None,
            master_interface: str | None = None) -> tuple[Any, Endpoint]:
    """Form the store every rank shares; returns it (a torch.distributed TCPStore) and its
    address. ``record``: this rank's placement (host, GPU), which rank 0 can read back with
    :func:`placements` (the summary's rank -> node -> GPU map). ``master_interface``: rank 0
    publishes that interface's address instead of its host name (cluster.master_interface).

    ``agent_store``: a process above the ranks already holds a store at MASTER_ADDR and
    MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE). "supervisor": hpc_ddp's own, new for every
    attempt: every rank is its client, keys under a prefix of their own. "torchrun": its
    agent's store outlives torchrun's restarts (the c10d rendezvous keeps it), so an earlier
    attempt's check-ins are still there, and TORCHELASTIC_RESTART_COUNT differs between
    nodes (it counts failures only, not restarts for a changed membership); rank 0 then makes
    a fresh store and publishes it on the agent's, and a rank that finds a published store it
    cannot reach (the last attempt's, whose processes torchrun stopped) reads again.

    Every rank does O(1) store operations and file reads, whatever the world size: no rank
    polls the store (the check-in ends with one blocking wait), and the endpoint file is read
    with a backoff. Raises RendezvousError naming the ranks (and their expected hosts) that
    never arrived.
    """
    import torch.distributed as dist  # deferred: torch

    mine = json.dumps(record or {"host": host})
    if agent_store and env.master_addr and env.master_port:
        endpoint = Endpoint(env.master_addr, env.master_port)
        shared = _client_store(env, endpoint, timeout_s, collective_timeout_s)
        if agent_store == "supervisor":
            store: Any = dist.PrefixStore(attempt_prefix(env.restart), shared)
            check_in(store, env, mine, timeout_s)
        else:
            store, endpoint = _fresh_store(env, shared, host, timeout_s, collective_timeout_s,
                                           master_interface, mine)
            _await_all(store, env, timeout_s)
        return store, endpoint
    if env.is_master:
        store, endpoint = _serve(env, host, collective_timeout_s, master_interface,
                                 env.master_port or 0)
        publish(endpoint_file(folder, env), endpoint, host)
        log.info("rendezvous: rank 0 listens on %s (published in %s)", endpoint,
                 endpoint_file(folder, env))
    elif env.master_addr and env.master_port:
        endpoint = Endpoint(env.master_addr, env.master_port)
        store = _client_store(env, endpoint, timeout_s, collective_timeout_s)
    else:
        store, endpoint = _join_published(env, endpoint_file(folder, env), timeout_s,
                                          collective_timeout_s)
    check_in(store, env, mine, timeout_s)
    return store, endpoint


def _serve(env: DistEnv, host: str, collective_timeout_s: float,
           master_interface: str | None, port: int = 0) -> tuple[Any, Endpoint]:
    """Rank 0's store on a port the kernel hands out (port 0: no formula can collide; else
    a MASTER_PORT the user set), on every address (IPv4 and IPv6), with this attempt's nonce
    set before anyone can read the address."""

    import torch.distributed as dist  # deferred: torch

    store = dist.TCPStore("0.0.0.0", port, env.world_size, True,
                          timedelta(seconds=collective_timeout_s), wait_for_workers=False)
    nonce = uuid.uuid4().hex
    store.set(_NONCE_KEY, nonce)
    return store, Endpoint(_master_addr(env, host, master_interface), store.port, nonce)


def _join_published(env: DistEnv, path: Path, timeout_s: float,
                    collective_timeout_s: float) -> tuple[Any, Endpoint]:
    """A client: read rank 0's endpoint (backing off), reach it, check its nonce; a file that
    leads nowhere or to another store is read again until the timeout."""
    deadline = time.monotonic() + timeout_s
    seen: Endpoint | None = None
    last = "no endpoint file yet"

    def attempt() -> tuple[Any, Endpoint] | None:
        nonlocal seen, last
        published = read_endpoint(path)
        if published is None:
            return None
        seen = endpoint = Endpoint(env.master_addr or published.addr, published.port,
                                   published.nonce)
        store, last = _try_store(env, endpoint, deadline, collective_timeout_s)
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
               collective_timeout_s: float) -> tuple[Any | None, str]:
    """(the store at ``endpoint`` if it is this attempt's, else None and why not)."""
    import torch.distributed as dist  # deferred: torch

    try:
        socket.create_connection((endpoint.addr, endpoint.port), timeout=2).close()
        store = dist.TCPStore(endpoint.addr, endpoint.port, env.world_size, False,
                              timedelta(seconds=max(2.0, min(10.0, deadline - time.monotonic()))),
                              wait_for_workers=False)
    except (OSError, RuntimeError) as exc:  # refused, unresolvable, not a store
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if endpoint.nonce:
        try:
            found = bytes(store.get(_NONCE_KEY)).decode() if store.check([_NONCE_KEY]) else ""
        except RuntimeError:
            found = ""
        if found != endpoint.nonce:
            return None, "a store of another run answers there (a stale endpoint file)"
    store.set_timeout(timedelta(seconds=collective_timeout_s))
    return store, ""


_AGENT_KEY = "hpc_ddp/endpoint"


def _fresh_store(env: DistEnv, agent: Any, host: str, timeout_s: float,
                 collective_timeout_s: float, master_interface: str | None,
                 record: str) -> tuple[Any, Endpoint]:
    """This attempt's own store, published on torchrun's agent store (see connect), and this
    rank announced in it. The agent's key may still name the last attempt's store, alive
    while its rank 0 winds down: a store every rank of an attempt has arrived in already is
    that one (this rank would be one too many), and the key is read again until it changes."""
    if env.is_master:
        # Its own address: torchrun's MASTER_ADDR is the agent store's host (the rendezvous
        # endpoint), which need not be the node rank 0 runs on.
        store, endpoint = _serve(dataclasses.replace(env, master_addr=None), host,
                                 collective_timeout_s, master_interface)
        _announce(store, env, record)
        agent.set(_AGENT_KEY, json.dumps({"addr": endpoint.addr, "port": endpoint.port,
                                          "nonce": endpoint.nonce}))
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
        named = Endpoint(str(data["addr"]), int(data["port"]), str(data.get("nonce", "")))
        store, why = _try_store(env, named, deadline, collective_timeout_s)
        if store is None:
            return None
        if _announce(store, env, record):
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


def attempt_prefix(restart: int) -> str:
    """The store prefix of an attempt's keys under an agent's store."""
    return f"hpc_ddp_attempt/{restart}/"


def _master_addr(env: DistEnv, host: str, master_interface: str | None = None) -> str:
    """What rank 0 publishes: a MASTER_ADDR the environment gives; else the address of
    cluster.master_interface (e.g. ib0, where host names resolve to a slow management
    network); else its host name (loopback for a run on one machine)."""
    if env.master_addr:
        return env.master_addr
    if env.source in ("local", "single"):
        return "127.0.0.1"
    if master_interface:
        from hpc_ddp.rank.join import netif  # deferred (start-up): rank.join.netif

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
    """A client of the store at a known address (MASTER_ADDR and MASTER_PORT given, or an
    agent's): reached with a backoff until the timeout."""
    deadline = time.monotonic() + timeout_s
    why = ""

    def attempt() -> Any:
        nonlocal why
        # A plain socket probe inside _try_store first: TCPStore's own connect retries with
        # long random delays past its timeout, which would blur the deadline we promise.
        store, why = _try_store(env, endpoint, deadline, collective_timeout_s)
        return store

    store = _until(deadline, attempt)
    if store is None:
        raise RendezvousError(
            f"rank {env.rank} could not reach rank 0 at {endpoint} within "
            f"{timeout_s:.0f}s ({why or 'no answer'}). Check that {endpoint.addr} "
            "resolves and is reachable from this node, and MASTER_ADDR if you set it.")
    return store


def check_in(store: Any, env: DistEnv, record: str, timeout_s: float) -> None:
    """Every rank announces itself and waits once for all (no polling: the store answers the
    wait when the last rank's announcement sets the key); rank 0 names the ranks that never
    came, and the others report rank 0's list."""
    if not _announce(store, env, record):
        raise RendezvousError(
            f"rank {env.rank} arrived at a rendezvous all {env.world_size} ranks had joined "
            "already: two processes were started as the same rank (e.g. srun -n above the "
            "world size, or a launcher started twice), or the store is another attempt's.")
    _await_all(store, env, timeout_s)


def _announce(store: Any, env: DistEnv, record: str) -> bool:
    """This rank's arrival (its record, then the count); False when the store had every
    rank already: an earlier attempt's, or a second process of this rank."""
    store.set(f"hpc_ddp/arrived/{env.rank}", record)
    arrived = int(store.add(_ARRIVED, 1))
    if arrived > env.world_size:
        return False
    if arrived == env.world_size:
        store.set(_ALL_ARRIVED, "1")  # the last to arrive releases everyone's wait
    return True


def _await_all(store: Any, env: DistEnv, timeout_s: float) -> None:
    # Rank 0 waits a little longer than the others try, so a rank that cannot reach it has
    # written its own reason (the address it tried) before rank 0 fails the job.
    margin = _MASTER_MARGIN_S if env.is_master else 0.0
    if not _wait(store, _ALL_ARRIVED, timeout_s + margin):
        if env.is_master:
            message = _missing_message(store, env, timeout_s)
            store.set(_MISSING, message)
            time.sleep(1.0)  # the waiting ranks read it before this process (the store) ends
            raise RendezvousError(message)
        said = ""
        if _wait(store, _MISSING, _MASTER_MARGIN_S + 5):
            with contextlib.suppress(RuntimeError):  # the store went with rank 0 meanwhile
                said = bytes(store.get(_MISSING)).decode()
        raise RendezvousError(said or (
            f"not every rank joined the rendezvous within {timeout_s:.0f}s; rank 0's log "
            "(logs/rank0.log) names the ranks that never came."))
    # All present: a rank that leaves early must not take the store down under the others.
    store.set_timeout(timedelta(seconds=max(timeout_s, 60)))


def _wait(store: Any, key: str, timeout_s: float) -> bool:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return True
    except RuntimeError:  # torch's DistStoreError: the wait timed out, or the store is gone
        return False


def _missing_message(store: Any, env: DistEnv, timeout_s: float) -> str:
    """Rank 0 alone, once, on a failed rendezvous: one check per rank."""
    missing = [r for r in range(env.world_size) if not store.check([f"hpc_ddp/arrived/{r}"])]
    shown = ", ".join(
        f"{r} (expected on {env.expected_host(r)})" if env.expected_host(r) else str(r)
        for r in missing
    )
    return (
        f"{len(missing)} of {env.world_size} ranks never joined the rendezvous within "
        f"{timeout_s:.0f}s: rank(s) {shown}. Their logs (logs/rank<N>.log) say why; a rank "
        "that cannot reach rank 0 reports the address it tried."
    )


def placements(store: Any, world_size: int) -> list[dict[str, Any]]:
    """Every rank's check-in record, in rank order (for rank 0's summary: one read of the
    store per rank by rank 0 alone, nothing on the other ranks)."""
    keys = [f"hpc_ddp/arrived/{r}" for r in range(world_size)]
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k)
                                                                          for k in keys]
    found = []
    for rank, raw in enumerate(values):
        try:
            record = json.loads(bytes(raw).decode())
        except (ValueError, UnicodeDecodeError):
            record = {"host": bytes(raw).decode(errors="replace")}
        found.append({"rank": rank, **record})
    return found
