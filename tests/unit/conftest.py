"""Fixtures the unit tests share."""

import signal
from collections.abc import Iterator

import pytest

from tests.unit.one_rank import one_rank_group

__all__ = ["one_rank_group", "stop_signals_kept"]


@pytest.fixture(autouse=True)
def stop_signals_kept() -> Iterator[None]:
    """The test process's handlers for the stop signals as they were: a task entry called
    in-process (train.main, step.main) holds them (rank/services/early_signals.py), and a
    stop request installs its own."""
    from hpc_ddp.rank.services import early_signals

    kept = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    yield
    for signum, handler in kept.items():
        signal.signal(signum, handler)
    early_signals.take()
    early_signals.HELD.clear()
