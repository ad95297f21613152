"""The folder of this user's warm processes kept tidy by each starter (client._start_once):
what killed warm processes left there, and kept warm processes no run uses.

A kept warm process (kept.py) holds ~0.4 GB of its own while it waits for a next run; runs
whose interpreter, files or environment differ (another project, a copy of the code) each
start their own. So a starter of a kept warm process asks the others to leave if they are
idle (no rank forked, no client, for 10 s: not one between two runs of a sweep): this user
keeps at most one kept warm process idle for longer, the latest, besides those in use. Warm
processes of a launch (Slurm steps, cluster.warm_keep_s=0) are not kept and stay (they leave
with their launch).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from hpc_ddp.rank.warm import wire

# A lock file with no socket this old is a gone launch's (a launch's own tasks open theirs
# within seconds of each other); so is a kept warm process's log.
_ORPHAN_S = 3600.0
# A warm process answers between forks: at once unless it is forking.
_ANSWER_S = 1.0


def locked(lock_path: Path) -> bool:
    """Whether a warm process holds ``lock_path`` (one starting)."""
    try:
        lock = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(lock)


def sweep(place: Path, keep: Path) -> None:
    """Remove what warm processes killed before they could clean up left (a killed launch:
    a socket nobody listens on, its lock free)."""
    for sock in place.glob("*.sock"):
        if sock == keep:
            continue
        lock_path = sock.with_suffix(".lock")
        try:
            lock = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a warm process starting
            try:
                wire.connect(sock).close()
            except ConnectionRefusedError:
                sock.unlink(missing_ok=True)
                lock_path.unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            os.close(lock)
    # A lock whose launch is long gone (killed before its starter removed it, or opened
    # again by a late task after that): no socket beside it, nobody holding it, old.
    for left in [*place.glob("*.lock"), *place.glob("*.log")]:
        if left.with_suffix(".sock") == keep or left.with_suffix(".sock").exists():
            continue
        with contextlib.suppress(OSError):
            if time.time() - left.lstat().st_mtime > _ORPHAN_S and not locked(left):
                left.unlink()


def evict_idle(place: Path, keep: Path) -> list[Path]:
    """Ask every other kept warm process that is idle to leave now; the sockets of those
    that said they would."""
    left = []
    for sock in place.glob("*.sock"):
        if sock == keep:
            continue
        with contextlib.suppress(OSError):
            with wire.connect(sock) as conn:
                wire.send(conn, {"op": "leave"})
                conn.settimeout(_ANSWER_S)
                answer, _ = wire.receive(conn)
                if answer and answer.get("leaving"):
                    left.append(sock)
    return left
