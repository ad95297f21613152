"""Does a submit go to a remote cluster? Read from the command line alone, before anything
is composed or imported (the local path pays nothing for the remote one)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

TRUE = ("true", "True", "1")


def given(overrides: Sequence[str], key: str) -> str | None:
    """The value of ``key=`` on the command line (the last one), or None."""
    value = None
    for o in overrides:
        name, eq, v = o.lstrip("+").partition("=")
        if eq and name == key:
            value = v
    return None if value in (None, "", "null") else value


def wanted(overrides: Sequence[str]) -> bool:
    """Does this command go to a remote cluster: ``cluster.remote=HOST``, or a resume of a
    run dir that is a remote run's handle."""
    if given(overrides, "cluster.remote"):
        return True
    run_dir = given(overrides, "run_dir")
    if not (run_dir and given(overrides, "resume") in TRUE):
        return False
    from hpc_ddp.remote.handle import FILE  # deferred (start-up): remote.handle

    return (Path(run_dir) / FILE).is_file()
