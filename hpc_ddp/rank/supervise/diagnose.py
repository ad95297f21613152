"""After a collective failed: which rank stopped answering, and on which host.

Gloo's timeout ("Timed out waiting 20000ms for recv") names no peer, and a reset connection
names only an address. The surviving ranks check in on the rendezvous store, each with two
operations; the first of them (the reporter) names the ranks that never do: the dead or hung
ones. A rank that failed by itself says so on the store, one key the others read. If the
store died with rank 0, one rank (the fallback reporter) matches the peer address in the
error against the addresses every rank recorded in run_dir/ranks/. No rank's work grows with
the world size but the reporter's single read of the survivors' list.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpc_ddp.errors import UserError
from hpc_ddp.rank.join.tracebacks import LOCAL_MARK
from hpc_ddp.rundir import rank_records

_ADDRESS = re.compile(r"\[?(\d{1,3}(?:\.\d{1,3}){3})\]?:\d+")
# How a failed collective or a lost peer reads, from gloo, NCCL and the c10d store. Gloo's
# text depends on where the wait ended: "Timed out waiting ... for recv" in a buffer,
# "Application timeout caused pair closure" in a pair (a peer stopped mid-all-reduce, seen
# from DDP's backward hook as a bare RuntimeError).
_COMM = re.compile(r"gloo|nccl|ProcessGroup|c10d|Connection (closed|reset|refused)|Timed out "
                   r"waiting|timed out|Broken pipe|socket|recv|Watchdog|pair closure|"
                   r"Application timeout", re.IGNORECASE)
# What another node or a later attempt may not meet again: the hardware, the file system.
_HARDWARE = re.compile(r"CUDA error|ECC|uncorrectable|Xid|device-side|NVLink|cuDNN error",
                       re.IGNORECASE)


def is_comm_failure(error: BaseException) -> bool:
    """The collective or the store failed (a peer died, hung or lost its network). Never a
    setting refused (UserError), whose message may name Gloo or NCCL."""
    if isinstance(error, UserError):
        return False
    try:
        from torch.distributed import DistError  # optional: torch

        if isinstance(error, DistError):
            return True
    except ImportError:
        pass
    return bool(_COMM.search(f"{type(error).__name__}: {error}"))


def reads_as_comm_failure(text: str) -> bool:
    """What a process printed last reads as a lost peer or a failed collective (a script's
    traceback, which its supervisor sees only as text)."""
    return bool(_COMM.search(text))


def worth_requeue(error: BaseException) -> bool:
    """A requeue may get past it: a lost peer, a bad node, a file system hiccup. A bug, bad
    input or running out of memory fails the same way on every attempt."""
    import torch  # deferred: torch

    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return False
    return (is_comm_failure(error) or isinstance(error, OSError | TimeoutError)
            or bool(_HARDWARE.search(str(error))))


def own_error(error: BaseException, max_lines: int = 8, max_chars: int = 1200) -> str:
    """The error as a user needs it: its type and its whole message, within bounds (a state
    dict mismatch lists the keys on the lines after the first)."""
    if isinstance(error, UserError):  # one line that names key, value and fix already
        return error.message
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = "\n".join(lines[:max_lines]) + ("\n..." if len(lines) > max_lines else "")
    text = text if len(text) <= max_chars else text[:max_chars] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def peer_error(store: Any, logs: Path) -> str | None:
    """The error of a rank that failed by itself in this attempt, if one did: the cause of
    this rank's failed collective. It publishes its first line on the store (one read here,
    whatever the world size); with the store gone (it lived in rank 0's process), rank 0's
    error file is the one to read (each rank removes its own when it joins)."""
    if store is not None:
        try:
            if store.check([OWN_FAILURE]):
                return bytes(store.get(OWN_FAILURE)).decode() or None
            return None
        except Exception:  # the store died with rank 0: its file says whether it failed itself
            pass
    try:
        first = (logs / "rank0.error").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    if LOCAL_MARK in first:
        return first.replace(f"{LOCAL_MARK} ", "").replace(LOCAL_MARK, "").strip()
    return None


def publish_own_failure(store: Any, line: str) -> None:
    """Tell the other ranks that this rank failed by itself (``line``: "rank N on host: ...")."""
    if store is None:
        return
    try:
        store.set(OWN_FAILURE, line)
    except Exception:  # no store to tell: the error file is there for rank 0's readers
        pass




# Store keys of a failure: the survivors' check-ins (a list and a count), the rank that names
# the silent ones, the first line of a rank that failed by itself.
_SURVIVORS = "hpc_ddp/failed/ranks"
_COUNT = "hpc_ddp/failed/count"
_REPORTER = "hpc_ddp/failed/reporter"
OWN_FAILURE = "hpc_ddp/own_failure"
POLL_S = 0.2


@dataclass(frozen=True)
class Survey:
    """What a surviving rank learnt from the store after its collective failed."""

    store_alive: bool
    # The rank that names the silent ones (this one, another, or None: unknown).
    reporter: int | None = None
    # The ranks that never checked in (known on the reporter only).
    silent: tuple[int, ...] = ()


def survey(store: Any, rank: int, world_size: int, wait_s: float) -> Survey:
    """Check in as a survivor: two store operations on every rank (an append to one list, an
    add to one counter). The first to check in is the reporter: it watches the counter (one
    operation per poll) for ``wait_s`` and reads the list once; the ranks that never came are
    the dead or hung ones."""
    try:
        store.set_timeout(timedelta(seconds=max(wait_s, 1.0)))
        store.append(_SURVIVORS, f"{rank},")
        if int(store.add(_COUNT, 1)) != 1:
            reporter = int(bytes(store.get(_REPORTER)).decode()) if store.check(
                [_REPORTER]) else None
            return Survey(True, reporter)
        store.set(_REPORTER, str(rank))
        deadline = time.monotonic() + wait_s
        while int(store.add(_COUNT, 0)) < world_size and time.monotonic() < deadline:
            time.sleep(POLL_S)
        came = {int(r) for r in bytes(store.get(_SURVIVORS)).decode().split(",") if r}
        return Survey(True, rank, tuple(r for r in range(world_size) if r not in came))
    except Exception:  # the store lived in rank 0's process: it may be the dead one
        return Survey(False)


def fallback_reporter(num_nodes: int, local_world_size: int, world_size: int) -> int:
    """The rank that reports (and requeues) when rank 0's store is gone: the first rank of the
    second node (it survives the loss of rank 0's node), else rank 1."""
    return min(local_world_size if num_nodes > 1 else 1, world_size - 1)


def ranks_at(address: str, ranks_dir: Path) -> list[tuple[int, str]]:
    """(rank, host) of every rank that recorded ``address`` among its interfaces: rank 0's
    record first (the store died with its process, so it is the likely one: one read), else
    every record (the fallback reporter alone does this)."""
    found = _recorded_at(address, [ranks_dir / "rank0.json"])
    return found or _recorded_at(address, rank_records(ranks_dir))


def _recorded_at(address: str, paths: list[Path]) -> list[tuple[int, str]]:
    found = []
    for path in paths:
        try:
            info = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if any(address in addrs for addrs in info.get("addresses", {}).values()):
            found.append((int(info["rank"]), str(info["host"])))
    return found


def hosts_of(ranks: list[int], ranks_dir: Path) -> dict[int, str]:
    hosts = {}
    for r in ranks:
        try:
            hosts[r] = str(json.loads((ranks_dir / f"rank{r}.json").read_text())["host"])
        except (OSError, json.JSONDecodeError, KeyError):
            hosts[r] = "an unknown host"
    return hosts


def explain(error: BaseException, found: Survey, rank: int, ranks_dir: Path,
            locate: Callable[[list[int]], dict[int, str]] | None = None,
            search: bool = False) -> str:
    """One sentence naming the rank(s) and host(s) that stopped answering, if this rank can
    tell, and (``locate``: rank -> where its stack was) the line each was on. ``search``:
    with the store gone, match the peer address in the error against every rank's record
    (one rank does it: the fallback reporter)."""
    first = own_error(error, max_lines=1, max_chars=400)
    if found.silent:
        silent = list(found.silent)
        hosts = hosts_of(silent, ranks_dir)
        places = locate(silent) if locate is not None else {}
        who = ", ".join(f"rank {r} on {hosts[r]}"
                        + (f" (was in {places[r]})" if r in places else "") for r in silent)
        return f"{who} stopped answering (dead or hung); this rank's collective failed: {first}"
    if not found.store_alive:
        match = _ADDRESS.search(str(error)) if search else None
        peers = ranks_at(match.group(1), ranks_dir) if match else []
        if peers:
            who = " or ".join(f"rank {r} on {h}" for r, h in peers)
            return f"{who} stopped answering (connection lost): {first}"
        return (f"rank 0's store is gone (rank 0 on {hosts_of([0], ranks_dir)[0]} died or lost "
                f"its network): {first}")
    if found.reporter is not None and found.reporter != rank:
        return (f"a collective failed: {first} (rank {found.reporter} names the ranks that "
                "stopped answering)")
    return f"a collective failed: {first}"
