"""Does a submit go to a remote cluster? Read from the command line alone, before anything
is composed or imported (the local path pays nothing for the remote one): each value as
the composed config will read it (hpc_ddp/config/given.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hpc_ddp.config.given import flag, text


def wanted(overrides: Sequence[str]) -> bool:
    """Does this command go to a remote cluster: ``cluster.remote=HOST``, or a resume of a
    run dir that is a remote run's handle."""
    if text(overrides, "cluster.remote"):
        return True
    run_dir = text(overrides, "run_dir") if flag(overrides, "resume") else None
    if not run_dir:
        return False
    from hpc_ddp.remote.handle import FILE  # deferred (start-up): remote.handle

    return (Path(run_dir) / FILE).is_file()
