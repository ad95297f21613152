"""Which Context ``hpc_ddp.context()`` returns in this process: the function entry's while it
runs, or, in a script hpc_ddp started, one made once from the environment its supervisor gave
it (context/script.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hpc_ddp.rank.context.context import Context
from hpc_ddp.rank.context.script import from_environment

_ACTIVE: list[Context] = []


@contextmanager
def active(ctx: Context) -> Iterator[Context]:
    """Make ``ctx`` what ``hpc_ddp.context()`` returns in this process meanwhile."""
    _ACTIVE.append(ctx)
    finished = False
    try:
        yield ctx
        finished = True
    finally:
        _ACTIVE.remove(ctx)
        ctx.close(finished)


def current() -> Context:
    """The context of this rank: the function entry's, or, in a script hpc_ddp started, one
    made from the environment it was given (hpc_ddp.rank.context.script)."""
    if _ACTIVE:
        return _ACTIVE[-1]
    ctx = from_environment()
    _ACTIVE.append(ctx)
    return ctx
