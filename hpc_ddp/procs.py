"""Whether a process is alive (for pid files, temp files and local job controllers)."""

from __future__ import annotations

import os


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (/proc/<pid>/stat field 22); None if
    it is gone. With the pid it names one process: pids are reused, often within hours."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[-1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, started: int | None = None) -> bool:
    """True while ``pid`` runs; a zombie (ended, not yet reaped) counts as ended, and so does
    another process that got the same pid when ``started`` (start_time) is given."""
    if pid <= 0:
        return False
    if started is not None and start_time(pid) not in (None, started):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True
