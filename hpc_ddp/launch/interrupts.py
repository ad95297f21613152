"""The submit command's stop signals: Ctrl-C (SIGINT), a `kill` (SIGTERM), a closed terminal
(SIGHUP), each taken once, whatever arrives with it.

A terminal's Ctrl-C goes to every process of the foreground group, and a wrapper in that
group (`timeout`, `nohup`, a make rule) passes its own copy on: the command gets two SIGINTs
a millisecond apart. Python's own handler would raise the second ``KeyboardInterrupt`` in the
middle of handling the first, and the ranks of a local run would never be told to stop. So:

- the first signal raises :class:`Stopped` (a ``KeyboardInterrupt``) where the command is;
- whatever arrives within :data:`SAME_PRESS_S` of it is the same press, and is dropped;
- a later one raises ``KeyboardInterrupt`` only inside :meth:`StopSignals.second_stops_at_once`
  (a local run's graceful stop, which it cuts short: docs/quickstart.md); anywhere else the
  first one is already being acted on and it is dropped too;
- inside :meth:`StopSignals.held` (while a submission goes out) the first signal waits until
  the block ends, so the command always knows what it submitted before it stops.

Only the command installs this (``python -m hpc_ddp.submit``); the Python API leaves the
signals of the caller's process alone.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Signals this close to the first are copies of it (a wrapper's, a double tap): seconds.
SAME_PRESS_S = 1.0


class Stopped(KeyboardInterrupt):
    """A stop signal to the command: Ctrl-C or SIGTERM/SIGHUP (``signum`` says which)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(exc: BaseException) -> int:
    """128 + the signal, as a shell reports a command a signal ended (130 for Ctrl-C)."""
    return 128 + int(getattr(exc, "signum", signal.SIGINT))


def name(exc: BaseException) -> str:
    """"Ctrl-C", or the signal's name (SIGTERM, SIGHUP), for the line that says it stopped."""
    signum = int(getattr(exc, "signum", signal.SIGINT))
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopSignals:
    """The handler of SIGINT, SIGTERM and SIGHUP for the whole command (see the module)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.first: tuple[int, float] | None = None  # (signal, when) of the first one
        self.dropped = 0  # signals after the first that were not acted on
        self._held = 0
        self._pending: int | None = None
        self._armed = False

    def install(self) -> None:
        for signum in SIGNALS:
            signal.signal(signum, self.handle)

    def handle(self, signum: int, frame: object = None) -> None:
        now = self.clock()
        if self.first is None:
            self.first = (signum, now)
            if self._held:
                self._pending = signum
                return
            raise Stopped(signum)
        if self._armed and now - self.first[1] >= SAME_PRESS_S:
            self._armed = False  # a third one does not interrupt the kill it asked for
            raise Stopped(signum)
        self.dropped += 1

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A block no stop signal interrupts; one that came meanwhile is raised at its end
        (not when the block raised: that exception is the news)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        pending, self._pending = self._pending, None
        if pending is not None and not self._held:
            raise Stopped(pending)

    @contextlib.contextmanager
    def second_stops_at_once(self) -> Iterator[None]:
        """A block a second, separate signal interrupts (``Stopped``): a graceful stop the
        user may cut short."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False


_installed: StopSignals | None = None


def install() -> StopSignals | None:
    """Take the stop signals for this process (the command's main thread only); SIGINT is
    taken even where it was ignored at start (`cmd &` in a script)."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return None
    _installed = StopSignals()
    _installed.install()
    return _installed


def held() -> contextlib.AbstractContextManager[None]:
    """:meth:`StopSignals.held` of the command, or nothing under the Python API."""
    return _installed.held() if _installed is not None else contextlib.nullcontext()


def second_stops_at_once() -> contextlib.AbstractContextManager[None]:
    """:meth:`StopSignals.second_stops_at_once` of the command, or nothing under the API."""
    return (_installed.second_stops_at_once() if _installed is not None
            else contextlib.nullcontext())
