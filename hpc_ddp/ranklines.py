"""The lines of a rank's log (``run_dir/logs/rank<N>.log``): written on the rank, read by
``python -m hpc_ddp.logs`` (docs/observability.md).

Every line has the same shape, so one rank's file, or a few, or all of them merged in time
order, read the same::

    2026-11-30 10:00:01.123 [rank 3 node2] ATTEMPT job=42.0 restart=1 generation=0
    2026-11-30 10:00:01.130 [rank 3 node2] INFO step 10/40 epoch 0 loss 2.1025 ...
    2026-11-30 10:00:01.131 [rank 3 node2] OUT epoch 1: accuracy 0.53
    2026-11-30 10:00:01.140 [rank 3 node2] ERR Traceback (most recent call last):

``INFO``, ``WARNING``, ``ERROR``: hpc_ddp's own lines; ``OUT`` and ``ERR``: the program's
stdout and stderr; ``ATTEMPT``: where one start of the rank (a job, a requeue, a restart in
place) begins. The time is this host's local time to the millisecond: its text sorts in time
order. Pure functions, the standard library only.
"""

from __future__ import annotations

import os
import re
import time
from typing import NamedTuple

ATTEMPT = "ATTEMPT"
OUT, ERR = "OUT", "ERR"
# "2026-11-30 10:00:01.123": 23 characters, then a space.
STAMP_LEN = 23
_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \[rank (\d+) ([^\]\s]*)\] (\S+) ?")


class Line(NamedTuple):
    """One parsed line: ``time`` as written (sortable text), rank, host, kind, text."""

    time: str
    rank: int
    host: str
    kind: str
    text: str


def stamp(when: float | None = None) -> str:
    """``when`` (time.time(); now if None) as a line's time."""
    when = time.time() if when is None else when
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) + \
        f".{int(when % 1 * 1000):03d}"


def prefix(rank: int, host: str) -> str:
    """What follows the time on every line of rank ``rank``."""
    return f"[rank {rank} {host}]"


def line(rank: int, host: str, kind: str, text: str, when: float | None = None) -> str:
    """One line (with its newline)."""
    return f"{stamp(when)} {prefix(rank, host)} {kind} {text}\n"


def parse(text: str) -> Line | None:
    """A line as written; None for text that is not one (a continuation is read as part of
    the line before it, see :func:`read`)."""
    found = _LINE.match(text)
    if found is None:
        return None
    return Line(found[1], int(found[2]), found[3], found[4], text[found.end():].rstrip("\n"))


def is_own(text: str, own_prefix: str) -> bool:
    """``text`` is a line of this rank written already (``own_prefix``: :func:`prefix`)."""
    return text[STAMP_LEN + 1:STAMP_LEN + 1 + len(own_prefix)] == own_prefix and \
        _LINE.match(text) is not None


def attempt_text(job: str, restart: int, generation: int) -> str:
    """An ATTEMPT line's text: the launch's id, Slurm's restart count, the restart in place."""
    return f"job={job} restart={restart} generation={generation}"


def attempt_of(text: str) -> dict[str, str]:
    """An ATTEMPT line's fields (``job``, ``restart``, ``generation``)."""
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 7] -> "0-3,7" (what ``logs --ranks`` takes)."""
    parts: list[str] = []
    for rank in sorted(set(ranks)):
        if parts and rank == int(parts[-1].rsplit("-", 1)[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{rank}"
        else:
            parts.append(str(rank))
    return ",".join(parts)


# What a terminal acts on instead of showing: C0 controls but tab and newline, DEL, C1
# controls (U+0080-U+009F, which some terminals take as CSI/OSC introducers), and the bidi
# overrides that reorder what is shown. ESC starts the sequences that move the cursor, retitle
# the window or write the clipboard (OSC 52).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def for_terminal(text: str) -> str:
    """``text`` with every control character shown as ``\\xNN`` (``\\uNNNN``): a rank's output
    printed to a terminal cannot drive it (the files keep the bytes as written; ``logs --raw``
    prints them)."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else
                         f"\\u{ord(m[0]):04x}", text)


def open_for_append(path: str | os.PathLike[str]) -> int:
    """A rank log's descriptor, opened to append without following a symbolic link (one
    planted at ``logs/rank<N>.log`` would have every line written where it points: ELOOP
    instead, docs/security.md)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW,
                   0o666)
