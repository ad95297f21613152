"""A command of ours on the login node ends when the laptop's connection does.

Without a terminal, nothing tells a remote command that the ``ssh`` that started it is gone:
sshd sends no SIGHUP to a session without a pty, and notices a dead link only when TCP does
(hours, unless the site set ``ClientAliveInterval``: https://man.openbsd.org/sshd_config#ClientAliveInterval).
A ``submit ... wait=true`` or a ``logs --follow`` of a laptop that was killed, or whose link
dropped for good, would follow on, alone, until the job ends, and keep the laptop's shared
connection open with it.

So the laptop keeps the command's standard input open and writes a line to it every
:data:`HEARTBEAT_S` seconds (:class:`Heartbeat`, started by ``Ssh.opened(tethered=True)``);
the command there holds its end (:func:`hold`): at the end of its input (the laptop's ``ssh``
exited, killed or not) or after :data:`SILENCE_S` seconds without a line (the link is
gone), it ends itself with SIGTERM, as a Ctrl-C would end it: a followed Slurm job goes on,
the command says so and exits. ``python -P -m hpc_ddp.remote.tether hpc_ddp.status ARGS``
runs a forwarded command held so.
"""

from __future__ import annotations

import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

HEARTBEAT_S = 5.0
SILENCE_S = 30.0
# After its SIGTERM, the seconds a command gets to say what it leaves running and exit.
GRACE_S = 30.0
# What a laptop may run held (``python -m hpc_ddp.remote.tether MODULE``): its commands.
MODULES = ("hpc_ddp.status", "hpc_ddp.logs")


def hold(fd: int | None = None, silence_s: float = SILENCE_S) -> threading.Thread:
    """Watch ``fd`` (standard input) in the background; at its end or a silence of
    ``silence_s``, end this process (module doc)."""
    watched = sys.stdin.fileno() if fd is None else fd

    def watch() -> None:
        while True:
            ready, _, _ = select.select([watched], [], [], silence_s)
            if not ready or not os.read(watched, 4096):
                break
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(GRACE_S)
        os._exit(128 + signal.SIGTERM)  # it did not end: nothing of ours lingers here

    thread = threading.Thread(target=watch, name="hpc_ddp-tether", daemon=True)
    thread.start()
    return thread


class Heartbeat:
    """The laptop's side: a line every ``every_s`` seconds into ``proc``'s standard input,
    until the process ends or :meth:`stop` (which closes the input)."""

    def __init__(self, proc: subprocess.Popen[bytes], every_s: float = HEARTBEAT_S) -> None:
        assert proc.stdin is not None
        self._stdin: IO[bytes] = proc.stdin
        self._proc = proc
        self._every = every_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hpc_ddp-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(self._every) and self._proc.poll() is None:
            try:
                self._stdin.write(b"\n")
                self._stdin.flush()
            except (OSError, ValueError):  # the command ended, or the input was closed
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        try:
            self._stdin.close()
        except OSError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in MODULES:
        print(f"usage: python -P -m hpc_ddp.remote.tether {{{','.join(MODULES)}}} ARGS... "
              "(run by a laptop over SSH: docs/remote.md)", file=sys.stderr)
        return 2
    hold()
    sys.argv = [args[0], *args[1:]]
    try:
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
