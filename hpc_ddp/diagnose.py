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
from datetime import timedelta
from pathlib import Path
from typing import Any

_ADDRESS = re.compile(r"\[?(\d{1,3}(?:\.\d{1,3}){3})\]?:\d+")


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
            wait_s: float = 5.0) -> str:
    """One sentence naming the rank(s) and host(s) that stopped answering, if they can be told."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    silent = silent_ranks(store, rank, world_size, wait_s)
    if silent:
        hosts = hosts_of(silent, ranks_dir)
        who = ", ".join(f"rank {r} on {hosts[r]}" for r in silent)
        return f"{who} stopped answering (dead or hung); this rank's collective failed: {first}"
    if silent is None:
        match = _ADDRESS.search(str(error))
        peers = ranks_at(match.group(1), ranks_dir) if match else []
        if peers:
            who = " or ".join(f"rank {r} on {h}" for r, h in peers)
            return f"{who} stopped answering (connection lost): {first}"
    return f"a collective failed: {first}"
