"""Every rank checks in on the job's store, and waits once for all (rendezvous.py forms the
store): no rank polls; if some never come within the timeout, rank 0 names them and the
hosts they should have run on, and the others report rank 0's list."""

from __future__ import annotations

import contextlib
import json
import time
from datetime import timedelta
from typing import Any

from hpc_ddp.rank.join.distenv import DistEnv

_MASTER_MARGIN_S = 10.0
_ARRIVED = "hpc_ddp/arrived"
_ALL_ARRIVED = "hpc_ddp/all_arrived"
_MISSING = "hpc_ddp/missing"


class RendezvousError(RuntimeError):
    """The ranks could not meet; the message names who is missing and where."""


def check_in(store: Any, env: DistEnv, record: str, timeout_s: float) -> None:
    """Every rank announces itself and waits once for all (no polling: the store answers the
    wait when the last rank's announcement sets the key); rank 0 names the ranks that never
    came, and the others report rank 0's list."""
    if not announce(store, env, record):
        raise RendezvousError(
            f"rank {env.rank} arrived at a rendezvous all {env.world_size} ranks had joined "
            "already: two processes were started as the same rank (e.g. srun -n above the "
            "world size, or a launcher started twice), or the store is another attempt's.")
    await_all(store, env, timeout_s)


def announce(store: Any, env: DistEnv, record: str) -> bool:
    """This rank's arrival (its record, then the count); False when the store had every
    rank already: an earlier attempt's, or a second process of this rank."""
    store.set(f"hpc_ddp/arrived/{env.rank}", record)
    arrived = int(store.add(_ARRIVED, 1))
    if arrived > env.world_size:
        return False
    if arrived == env.world_size:
        store.set(_ALL_ARRIVED, "1")  # the last to arrive releases everyone's wait
    return True


def await_all(store: Any, env: DistEnv, timeout_s: float) -> None:
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
