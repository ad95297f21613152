"""A torchrun-style script under its supervisor joins the supervisor's store: torch's env://
handler, replaced for this process by one whose client proves the store's key."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

from hpc_ddp.rank.contract import GENERATION_ENV, STORE_KEY_ENV
from hpc_ddp.rank.join.rendezvous import Endpoint, attempt_prefix, client


def use_job_store(environ: Mapping[str, str]) -> bool:
    """Make ``init_process_group()`` with env:// (a torchrun-style script's, under its
    supervisor) join the supervisor's store with the key its environment holds, as a client
    that proves it (authstore.py): torch's own env:// handler would make a TCPStore client,
    which this store does not let in. The one place torch's handler table is touched
    (https://pytorch.org/docs/stable/distributed.html#environment-variable-initialization).
    The script's keys live under its generation's prefix (rendezvous.attempt_prefix), as a
    supervised trainer's do: a script started again in place never meets the addresses its
    last start left there. False where there is no such store (nothing changed)."""
    key = environ.get(STORE_KEY_ENV)
    if not key or environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False

    # The module (torch.distributed's own name `rendezvous` is the function of it).
    torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")

    def handler(url: str, timeout: timedelta = timedelta(minutes=30),
                **_: Any) -> Any:
        query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
        rank = int(query.get("rank", environ["RANK"]))
        world_size = int(query.get("world_size", environ["WORLD_SIZE"]))
        store = client(Endpoint(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), key),
                       timeout.total_seconds(), plain=False)  # the process group's: torch's
        generation = int(environ.get(GENERATION_ENV, "0") or 0)
        restart = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) - generation
        dist = importlib.import_module("torch.distributed")
        yield dist.PrefixStore(attempt_prefix(max(0, restart), generation), store), rank, \
            world_size
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    torch_rendezvous._rendezvous_handlers["env"] = handler
    return True
