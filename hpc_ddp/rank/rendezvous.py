"""A rendezvous that cannot collide and cannot hang silently.

Every peer tool derives MASTER_PORT from the job id, and two jobs sharing a node can collide.
Here rank 0 asks the kernel for a free port (a TCPStore bound to port 0), and publishes
address and port in the run directory, keyed by job, step and restart; the other ranks read
it from there (the run directory is on a shared filesystem, as submitit already requires).
A MASTER_PORT set by the user wins. Then every rank checks in; if some never do within the
timeout, the job fails naming those ranks and the hosts they should have run on.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpc_ddp.rank.distenv import DistEnv

log = logging.getLogger(__name__)

_POLL_S = 0.2
_MASTER_MARGIN_S = 10.0


class RendezvousError(RuntimeError):
    """The ranks could not meet; the message names who is missing and where."""


@dataclass(frozen=True)
class Endpoint:
    addr: str
    port: int


def endpoint_file(folder: Path, env: DistEnv) -> Path:
    # One file per job, step and restart: an earlier attempt's file is never read.
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in env.job_id)
    return folder / f"{safe}-r{env.restart}.json"


def publish(path: Path, endpoint: Endpoint, host: str) -> None:
    """Write the endpoint atomically (temp file + rename), so a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"addr": endpoint.addr, "port": endpoint.port, "host": host}))
    os.replace(tmp, path)


def wait_for_endpoint(path: Path, timeout_s: float, env: DistEnv) -> Endpoint:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            data = json.loads(path.read_text())
            return Endpoint(str(data["addr"]), int(data["port"]))
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            time.sleep(_POLL_S)
    where = env.expected_host(0) or "its node"
    raise RendezvousError(
        f"rank {env.rank} waited {timeout_s:.0f}s for rank 0 (on {where}) to publish its "
        f"address in {path}, but it never did: rank 0 did not start or cannot write there. "
        "Check rank 0's log, and that run_dir is on a filesystem every node shares."
    )


def connect(env: DistEnv, folder: Path, host: str, timeout_s: float,
            collective_timeout_s: float, record: dict[str, Any] | None = None,
            agent_store: str | None = None) -> tuple[Any, Endpoint]:
    """Form the store every rank shares; returns it (a torch.distributed TCPStore) and its
    address. ``record``: this rank's placement (host, GPU), which rank 0 can read back with
    :func:`placements` (the summary's rank -> node -> GPU map).

    ``agent_store``: a process above the ranks already holds a store at MASTER_ADDR and
    MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE). "supervisor": hpc_ddp's own, new for every
    attempt: every rank is its client, keys under a prefix of their own. "torchrun": its
    agent's store outlives torchrun's restarts (the c10d rendezvous keeps it), so an earlier
    attempt's check-ins are still there, and TORCHELASTIC_RESTART_COUNT differs between
    nodes (it counts failures only, not restarts for a changed membership); rank 0 then makes
    a fresh store and publishes it on the agent's, and a rank that finds a published store it
    cannot reach (the last attempt's, whose processes torchrun stopped) reads again.

    Raises RendezvousError naming the ranks (and their expected hosts) that never arrived.
    """
    import torch.distributed as dist

    path = endpoint_file(folder, env)
    if agent_store and env.master_addr and env.master_port:
        endpoint = Endpoint(env.master_addr, env.master_port)
        shared = _client_store(env, endpoint, timeout_s, collective_timeout_s)
        if agent_store == "supervisor":
            mine: Any = dist.PrefixStore(attempt_prefix(env.restart), shared)
            _check_in(mine, env, json.dumps(record or {"host": host}), timeout_s)
            return mine, endpoint
        mine, endpoint = _fresh_store(env, shared, host, timeout_s, collective_timeout_s)
        _check_in(mine, env, json.dumps(record or {"host": host}), timeout_s)
        return mine, endpoint
    if env.is_master:
        # Port 0: the kernel hands out a port nobody holds; no formula can collide.
        store = dist.TCPStore("0.0.0.0", env.master_port or 0, env.world_size, True,
                              timedelta(seconds=collective_timeout_s), wait_for_workers=False)
        endpoint = Endpoint(_master_addr(env, host), store.port)
        publish(path, endpoint, host)
        log.info("rendezvous: rank 0 listens on %s:%d (published in %s)",
                 endpoint.addr, endpoint.port, path)
    else:
        if env.master_addr and env.master_port:
            endpoint = Endpoint(env.master_addr, env.master_port)
        else:
            published = wait_for_endpoint(path, timeout_s, env)
            endpoint = Endpoint(env.master_addr or published.addr, published.port)
        store = _client_store(env, endpoint, timeout_s, collective_timeout_s)
    _check_in(store, env, json.dumps(record or {"host": host}), timeout_s)
    return store, endpoint


_AGENT_KEY = "hpc_ddp/endpoint"


def _fresh_store(env: DistEnv, agent: Any, host: str, timeout_s: float,
                 collective_timeout_s: float) -> tuple[Any, Endpoint]:
    """This attempt's own store, published on torchrun's agent store (see connect)."""
    import torch.distributed as dist

    if env.is_master:
        store = dist.TCPStore("0.0.0.0", 0, env.world_size, True,
                              timedelta(seconds=collective_timeout_s), wait_for_workers=False)
        endpoint = Endpoint(_master_addr(env, host), store.port)
        agent.set(_AGENT_KEY, json.dumps({"addr": endpoint.addr, "port": endpoint.port}))
        return store, endpoint
    deadline = time.monotonic() + timeout_s
    while True:
        data = json.loads(bytes(agent.get(_AGENT_KEY)).decode())  # waits until it is set
        endpoint = Endpoint(str(data["addr"]), int(data["port"]))
        try:
            socket.create_connection((endpoint.addr, endpoint.port), timeout=2).close()
            return _client_store(env, endpoint, timeout_s, collective_timeout_s), endpoint
        except OSError:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"rank {env.rank} found rank 0's store at {endpoint.addr}:{endpoint.port} "
                    f"on torchrun's store but could not reach it within {timeout_s:.0f}s."
                ) from None
            time.sleep(_POLL_S)


def attempt_prefix(restart: int) -> str:
    """The store prefix of an attempt's keys under an agent's store."""
    return f"hpc_ddp_attempt/{restart}/"


def _master_addr(env: DistEnv, host: str) -> str:
    if env.master_addr:
        return env.master_addr
    return "127.0.0.1" if env.source in ("local", "single") else host


def _client_store(env: DistEnv, endpoint: Endpoint, timeout_s: float,
                  collective_timeout_s: float) -> Any:
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    # Probe with a plain socket first: TCPStore's own connect retries with long random delays
    # past its timeout, which would blur the deadline we promise.
    _wait_reachable(env, endpoint, deadline, timeout_s)
    store = dist.TCPStore(endpoint.addr, endpoint.port, env.world_size, False,
                          timedelta(seconds=max(5.0, deadline - time.monotonic())),
                          wait_for_workers=False)
    store.set_timeout(timedelta(seconds=collective_timeout_s))
    return store


def _wait_reachable(env: DistEnv, endpoint: Endpoint, deadline: float, timeout_s: float) -> None:
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            remaining = max(0.1, min(2.0, deadline - time.monotonic()))
            socket.create_connection((endpoint.addr, endpoint.port), timeout=remaining).close()
            return
        except OSError as exc:  # refused, unresolvable, unreachable, timed out
            last = exc
            time.sleep(_POLL_S)
    raise RendezvousError(
        f"rank {env.rank} could not reach rank 0 at {endpoint.addr}:{endpoint.port} within "
        f"{timeout_s:.0f}s ({last or 'no answer'}). Check that {endpoint.addr} resolves and is "
        "reachable from this node, and MASTER_ADDR if you set it."
    )


def _check_in(store: Any, env: DistEnv, record: str, timeout_s: float) -> None:
    """Every rank announces itself; rank 0 names the ranks that never came."""
    from datetime import timedelta as _td

    store.set(f"hpc_ddp/arrived/{env.rank}", record)
    store.add("hpc_ddp/arrived", 1)
    # Rank 0 waits a little longer than the others try, so a rank that cannot reach it has
    # written its own reason (the address it tried) before rank 0 fails the job.
    deadline = time.monotonic() + timeout_s + (_MASTER_MARGIN_S if env.is_master else 0)
    while store.add("hpc_ddp/arrived", 0) < env.world_size:
        if time.monotonic() > deadline:
            raise RendezvousError(_missing_message(store, env, timeout_s))
        time.sleep(_POLL_S)
    # All present: a rank that leaves early must not take the store down under the others.
    store.set_timeout(_td(seconds=max(timeout_s, 60)))


def _missing_message(store: Any, env: DistEnv, timeout_s: float) -> str:
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
