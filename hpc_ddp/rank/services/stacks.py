"""Where a hung rank was: every training process can dump its Python stacks on a signal.

Each training process registers ``faulthandler`` for STACK_SIGNAL into
``logs/rank<N>.stacks`` (C-level: it writes even while the process is stuck inside a
collective or a C call; https://docs.python.org/3/library/faulthandler.html). When a rank's
collective fails because some ranks stopped answering, it sets one key per silent rank on the
rendezvous store (one multi_set); each rank's supervisor (rank/supervise/supervisor.py's
StackRelay, which waits on its own rank's key on a connection of its own: no polling)
signals its training process, and a rank on this host without a supervisor is signalled
directly. The supervisor sets its own key to DONE when its training process has ended, which
ends its waiting thread before the process exits (a thread still blocked in the store when
the interpreter finalizes aborts the process). Then the report names the line each silent
rank was on: "rank 3 on gpu-017 was in __getitem__ (my_loader.py line 88)".
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import IO, Any

from hpc_ddp.owned import open_append

KEY = "hpc_ddp/dump_stacks"
REQUEST = "dump"  # the value of a request for the stacks
DONE = "done"  # the value a supervisor sets to end its own wait
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_open: list[IO[str]] = []  # kept open for faulthandler, which writes to the descriptor


def stack_signal(requeue_signal: str) -> int:
    """SIGUSR1, unless the job's requeue signal is USR1 (then SIGUSR2 is free)."""
    return signal.SIGUSR2 if requeue_signal.upper().removeprefix("SIG") == "USR1" \
        else signal.SIGUSR1


def request_key(rank: int) -> str:
    """The key that rank ``rank``'s supervisor waits on."""
    return f"{KEY}/{rank}"


def enable(path: Path, signum: int) -> None:
    """Dump every thread's stack into ``path`` (appended) when ``signum`` arrives.
    owned.Untrusted where ``path`` is a symbolic link or not this user's file: every dump
    would go wherever it points (owned.open_append)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = os.fdopen(open_append(path), "a")  # must stay open for the process's life
    faulthandler.register(signum, file=handle, all_threads=True, chain=False)
    while _open:  # a process that joins again (a notebook, a benchmark): the old file is done
        _open.pop().close()
    _open.append(handle)


def request(store: Any, silent: list[int], ranks_dir: Path, host: str, signum: int,
            wait_s: float = 3.0, logs: Path | None = None) -> None:
    """Ask the silent ranks for their stacks: the store keys their supervisors wait on (one
    store call), and a signal to those on this host (found by pid in ranks/rank<N>.json);
    then give them ``wait_s`` to write: with ``logs``, until every one of them has written
    its ``rank<N>.stacks`` there (a loaded node's dump can take seconds: a report without
    the rank that hangs would name the ones that wait for it)."""
    asked = time.time()
    try:
        if silent:
            store.multi_set([request_key(r) for r in silent], [REQUEST] * len(silent))
    except Exception:  # the store died with rank 0's process: only the direct signal is left
        pass
    for rank in silent:
        try:
            record = json.loads((ranks_dir / f"rank{rank}.json").read_text())
            if record.get("host") == host and int(record.get("pid", 0)) > 0:
                os.kill(int(record["pid"]), signum)
        except (OSError, ValueError, KeyError):
            continue
    if logs is None:
        time.sleep(wait_s)
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(
            _written_since(logs / f"rank{r}.stacks", asked) for r in silent):
        time.sleep(0.1)
    time.sleep(0.2)  # the dump's last lines (faulthandler writes it at once)


def _written_since(path: Path, since: float) -> bool:
    try:
        stat = path.stat()
    except OSError:
        return False
    return stat.st_size > 0 and stat.st_mtime >= since - 1.0


def where(stacks_file: Path) -> str | None:
    """The innermost frame of the main thread in the last dump: "func (file line N)"."""
    try:
        text = stacks_file.read_text(errors="replace")
    except OSError:
        return None
    blocks = re.split(r"^(?=(?:Current thread|Thread) 0x)", text, flags=re.MULTILINE)
    # faulthandler lists the threads newest first: the main thread is the last block.
    for block in reversed([b for b in blocks if b.strip()]):
        for line in block.splitlines()[1:]:
            found = _FRAME.match(line)
            if found:
                return (f"{found['func']} ({_short(found['file'])} line {found['line']})")
        break
    return None


def _short(path: str) -> str:
    """A path as far as it helps: from site-packages or the last three parts."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    return "/".join(Path(path).parts[-3:])
