"""A stop signal that came before a user's script existed, passed on once it handles it.

Slurm's requeue signal or SIGTERM reaches every process of the step at once; one that came
while the supervisor joined (or while the script was being started) never reached the
script. Sent at once, it would find a script that has not set its handler yet (its own
imports, its model) and end it: a script that handles the signal would be reported as one
that does not, and not requeued. So the supervisor waits until the script catches the signal
(the kernel's SigCgt mask in /proc/PID/status, set when a handler is installed:
https://man7.org/linux/man-pages/man5/proc_pid_status.5.html), or at most a grace period
(a script that never handles it ends from it, as it would have from Slurm's), and sends it
then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# How often the script's signal state is read while waiting.
POLL_S = 0.1


def caught(pid: int) -> set[int] | None:
    """The signals process ``pid`` has a handler for; None when it cannot be read (gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    mask = int(line.split()[1], 16)
                    return {n + 1 for n in range(64) if mask >> n & 1}
    except (OSError, ValueError):
        return None
    return None


def grace_s(signal_delay_s: int) -> float:
    """How long a script may take to set its handler: a quarter of the warning's lead (it
    still needs the rest to checkpoint), at most 30 s (pure)."""
    return min(30.0, max(1.0, signal_delay_s / 4))


def pass_on(pid: int, signum: int, send: Callable[[int], None], grace: float,
            alive: Callable[[], bool], clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> str:
    """Wait for the script to catch ``signum`` (or ``grace`` seconds), then ``send`` it.
    Returns what happened: "caught", "grace" or "ended" (nothing sent)."""
    deadline = clock() + grace
    while alive():
        handled = caught(pid)
        if handled is None:
            break
        if signum in handled:
            send(signum)
            return "caught"
        if clock() >= deadline:
            send(signum)
            return "grace"
        sleep(POLL_S)
    return "ended"


def start(pid: int, signum: int, send: Callable[[int], None], grace: float,
          alive: Callable[[], bool]) -> threading.Thread:
    """:func:`pass_on` in a thread of its own (the supervisor goes on waiting for the script)."""
    thread = threading.Thread(target=pass_on, args=(pid, signum, send, grace, alive),
                              name="hpc_ddp-signal-handover", daemon=True)
    thread.start()
    return thread
