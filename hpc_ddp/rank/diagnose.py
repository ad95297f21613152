"""After a collective failed: which rank stopped answering, and on which host.

Gloo's timeout ("Timed out waiting 20000ms for recv") names no peer, and a reset connection
names only an address. The surviving ranks check in on the rendezvous store; the ranks that
never do are the dead or hung ones. If the store died with rank 0, the peer address in the
error is matched against the addresses every rank recorded in run_dir/ranks/.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

_ADDRESS = re.compile(r"\[?(\d{1,3}(?:\.\d{1,3}){3})\]?:\d+")
# How a failed collective or a lost peer reads, from gloo, NCCL and the c10d store.
_COMM = re.compile(r"gloo|nccl|ProcessGroup|c10d|Connection (closed|reset|refused)|Timed out "
                   r"waiting|timed out|Broken pipe|socket|recv|Watchdog", re.IGNORECASE)
# What another node or a later attempt may not meet again: the hardware, the file system.
_HARDWARE = re.compile(r"CUDA error|ECC|uncorrectable|Xid|device-side|NVLink|cuDNN error",
                       re.IGNORECASE)


def is_comm_failure(error: BaseException) -> bool:
    """The collective or the store failed (a peer died, hung or lost its network)."""
    try:
        from torch.distributed import DistError

        if isinstance(error, DistError):
            return True
    except ImportError:
        pass
    return bool(_COMM.search(f"{type(error).__name__}: {error}"))


def worth_requeue(error: BaseException) -> bool:
    """A requeue may get past it: a lost peer, a bad node, a file system hiccup. A bug, bad
    input or running out of memory fails the same way on every attempt."""
    import torch

    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return False
    return (is_comm_failure(error) or isinstance(error, OSError | TimeoutError)
            or bool(_HARDWARE.search(str(error))))


def own_error(error: BaseException, max_lines: int = 8, max_chars: int = 1200) -> str:
    """The error as a user needs it: its type and its whole message, within bounds (a state
    dict mismatch lists the keys on the lines after the first)."""
    from hpc_ddp.errors import UserError

    if isinstance(error, UserError):  # one line that names key, value and fix already
        return error.message
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = "\n".join(lines[:max_lines]) + ("\n..." if len(lines) > max_lines else "")
    text = text if len(text) <= max_chars else text[:max_chars] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def peer_error(logs: Path, rank: int, world_size: int) -> str | None:
    """The first line of another rank's error file from this attempt (each rank removes its
    own when it joins), if one failed by itself: the cause of this rank's failed collective."""
    for r in range(world_size):
        path = logs / f"rank{r}.error"
        if r == rank or not path.is_file():
            continue
        try:
            first = path.read_text().splitlines()[0]
        except (OSError, IndexError):
            continue
        if LOCAL_MARK in first:
            return first.replace(f"{LOCAL_MARK} ", "").replace(LOCAL_MARK, "").strip()
    return None


# Marks an error file whose rank failed on its own (not because a peer went away).
LOCAL_MARK = "[own failure]"


def silent_ranks(store: Any, rank: int, world_size: int, wait_s: float) -> list[int] | None:
    """Ranks that did not report within ``wait_s`` (None: the store itself is unreachable)."""
    try:
        store.set_timeout(timedelta(seconds=max(wait_s, 1.0)))
        store.set(f"hpc_ddp/failed/{rank}", "1")
        deadline = time.monotonic() + wait_s
        keys = [f"hpc_ddp/failed/{r}" for r in range(world_size)]
        while True:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except Exception:  # the store lived in rank 0's process: it may be the dead one
        return None


def ranks_at(address: str, ranks_dir: Path) -> list[tuple[int, str]]:
    """(rank, host) of every rank that recorded ``address`` among its interfaces."""
    found = []
    for path in sorted(ranks_dir.glob("rank*.json")):
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


def explain(error: BaseException, store: Any, rank: int, world_size: int, ranks_dir: Path,
            wait_s: float = 5.0,
            locate: Callable[[list[int]], dict[int, str]] | None = None) -> str:
    """One sentence naming the rank(s) and host(s) that stopped answering, if they can be
    told, and (``locate``: rank -> where its stack was) the line each was on."""
    first = own_error(error, max_lines=1, max_chars=400)
    silent = silent_ranks(store, rank, world_size, wait_s)
    if silent:
        hosts = hosts_of(silent, ranks_dir)
        places = locate(silent) if locate is not None else {}
        who = ", ".join(f"rank {r} on {hosts[r]}"
                        + (f" (was in {places[r]})" if r in places else "") for r in silent)
        return f"{who} stopped answering (dead or hung); this rank's collective failed: {first}"
    if silent is None:
        match = _ADDRESS.search(str(error))
        peers = ranks_at(match.group(1), ranks_dir) if match else []
        if peers:
            who = " or ".join(f"rank {r} on {h}" for r, h in peers)
            return f"{who} stopped answering (connection lost): {first}"
    return f"a collective failed: {first}"
