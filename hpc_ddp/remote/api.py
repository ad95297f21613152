"""The Python API's two forms: ``hpc_ddp.submit`` and ``hpc_ddp.open_run`` on this machine's
cluster (hpc_ddp/api.py) or, with ``cluster.remote=HOST``, on a cluster over SSH
(:class:`~hpc_ddp.remote.run.RemoteRun`): the same call in a notebook either way
(docs/api.md#from-your-laptop)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.api import Plan, Run, program_overrides
from hpc_ddp.api import submit as submit_here
from hpc_ddp.config.given import text
from hpc_ddp.errors import UserError
from hpc_ddp.remote import handle as handles
from hpc_ddp.remote.intent import wanted
from hpc_ddp.remote.run import RemoteRun


def submit(overrides: Sequence[str] | str | Plan = (), cwd: Path | None = None, *,
           config_dir: Path | str | None = None, entry: str | Callable[..., Any] | None = None,
           script_args: Sequence[str] | None = None) -> Run | RemoteRun:
    """:func:`hpc_ddp.api.submit`, or with ``cluster.remote=HOST`` (or the resume of a
    remote run's handle) the same submission on that cluster over SSH: its code copied, the
    config checked here first (docs/remote.md). Returns the run's handle at once."""
    if isinstance(overrides, Plan):
        return submit_here(overrides, cwd, config_dir=config_dir, entry=entry,
                           script_args=script_args)
    given = shlex.split(overrides) if isinstance(overrides, str) else list(overrides)
    if not wanted(given):
        return submit_here(given, cwd, config_dir=config_dir, entry=entry,
                           script_args=script_args)
    if callable(entry) and not isinstance(entry, str):
        name = f"{getattr(entry, '__module__', '')}:{getattr(entry, '__qualname__', '')}"
        if "<" in name or name.startswith("__main__:"):
            raise UserError("entry", name, "is a function of this notebook, which the "
                            "cluster cannot import.", "put it in a file of your project "
                            "(copied to the cluster with the rest) and pass "
                            "entry='module:function'.")
    extra, _ = program_overrides(entry, config_dir)
    # deferred (start-up): remote.submit_remote
    from hpc_ddp.remote.submit_remote import submit as submit_there

    sent = submit_there([*given, *extra],
                        list(script_args) if script_args is not None else None, False,
                        sys.stdout, cwd=cwd)
    if sent.status != 0 or sent.folder is None:
        said = [line for line in sent.said.strip().splitlines() if line.startswith("error: ")]
        raise UserError("cluster.remote", text(given, "cluster.remote") or "",
                        "the submit there refused: " + (said[-1].removeprefix("error: ")
                                                        if said else f"exit {sent.status}."),
                        "" if said else "see its lines above.")
    return RemoteRun(sent.folder)


def open_run(run_dir: Path | str) -> Run | RemoteRun:
    """The run in ``run_dir``: a :class:`Run`, or a :class:`RemoteRun` when it is the local
    handle of a remote run (after a kernel restart: the same run)."""
    if handles.read(Path(run_dir).expanduser()) is not None:
        return RemoteRun(run_dir)
    return Run.from_dir(run_dir)
