"""The process that writes a rank's output into the rank's log, line by line, and passes it on.

``python -m hpc_ddp.rank.join.tee LOG RANK HOST OUT_FD ERR_FD [MARKS]``, started by
rank/join/output.py with the read ends of two pipes (the rank's stdout and stderr) and the
rank's own stdout and stderr as its fds 1 and 2. Each line read:

- goes into LOG as ``<time> [rank N host] OUT|ERR <line>`` (hpc_ddp/ranklines.py), the text a
  terminal would show of it (after its last carriage return), and
- on to where the rank's output went before (submitit's per-task files, Slurm's output file, a
  terminal), as it was,

with secret values masked in both (hpc_ddp/redact.py: the values of this environment's
secret-named variables, and secret-shaped text; MARKS: secrets.secret / secrets.public as
JSON). Two kinds of line only pass: hpc_ddp's own log lines of this rank (already in LOG:
rank 0 echoes them to stderr) and one line torch prints for nothing on every Slurm rank (the
c10d socket's host name, see NOISE).

A separate process, not a thread of the rank: it outlives the rank's abrupt death (SIGKILL,
NCCL's SIGABRT) and writes its last words, and it ignores the signals a stop sends; it ends
when every writer has closed the pipes. Standard library and hpc_ddp's pure modules only: it
starts in a few tens of milliseconds.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys
from collections.abc import Mapping, Sequence

from hpc_ddp.owned import open_append
from hpc_ddp.ranklines import ERR, OUT, is_own, line, prefix
from hpc_ddp.redact import Marks, mask, values_to_mask

# torch (c10d socket.cpp, 2.14) warns on every rank whose host name its resolver cannot find
# back from a garbled address, although the connection is fine; nothing else is dropped.
NOISE = "The hostname of the client socket cannot be retrieved"
# The signals a stop sends to every process of a step: the tee outlives them.
IGNORED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGQUIT")
# A line without its newline yet (a progress bar) is passed on after this many seconds.
PARTIAL_S = 0.2


class Tee:
    """What the process does with the bytes it reads (kept apart from the loop: tested)."""

    def __init__(self, log_fd: int, rank: int, host: str, hidden: Sequence[str],
                 passes: Mapping[str, int]) -> None:
        self.log_fd, self.rank, self.host = log_fd, rank, host
        self.own = prefix(rank, host)
        self.hidden = list(hidden)
        self.passes = dict(passes)  # kind -> fd its lines are passed on to
        self.pending: dict[str, bytes] = {OUT: b"", ERR: b""}
        self.passed: dict[str, int] = {OUT: 0, ERR: 0}  # bytes of the pending line passed

    def feed(self, kind: str, data: bytes) -> None:
        """Bytes read from the rank's ``kind`` (OUT, ERR); b"" at the end of the stream."""
        buffer = self.pending[kind] + data
        if not data and buffer:
            buffer += b"\n"
        *whole, rest = buffer.split(b"\n")
        records, through = [], []
        for number, raw in enumerate(whole):
            text = mask(raw.decode(errors="replace"), self.hidden)
            start = self.passed[kind] if number == 0 else 0
            if NOISE in text:
                continue
            if is_own(text, self.own):
                through.append(raw[start:] + b"\n")
                continue
            shown = text.rstrip("\r").rsplit("\r", 1)[-1]
            records.append(line(self.rank, self.host, kind, shown))
            through.append(mask(raw[start:].decode(errors="replace"), self.hidden).encode()
                           + b"\n")
        if whole:
            self.passed[kind] = 0
        self.pending[kind] = rest
        self._write(self.log_fd, "".join(records).encode())
        self._pass(kind, b"".join(through))

    def flush_partial(self) -> None:
        """Pass on the part of an unfinished line not passed yet (it goes into the log once
        it is finished)."""
        for kind, pending in self.pending.items():
            new = pending[self.passed[kind]:]
            if new:
                self._pass(kind, mask(new.decode(errors="replace"), self.hidden).encode())
                self.passed[kind] = len(pending)

    def _pass(self, kind: str, data: bytes) -> None:
        fd = self.passes.get(kind)
        if fd is None or not data:
            return
        try:
            _write_all(fd, data)
        except OSError:  # the terminal went away (EIO), a closed file: the log still gets it
            self.passes.pop(kind, None)

    @staticmethod
    def _write(fd: int, data: bytes) -> None:
        if data:
            try:
                _write_all(fd, data)
            except OSError:
                pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def run(tee: Tee, streams: Mapping[str, int]) -> None:
    """Read ``streams`` (kind -> fd) until every one of them has ended."""
    selector = selectors.DefaultSelector()
    for kind, fd in streams.items():
        selector.register(fd, selectors.EVENT_READ, kind)
    while selector.get_map():
        waiting = any(p[tee.passed[k]:] for k, p in tee.pending.items())
        ready = selector.select(PARTIAL_S if waiting else None)
        if not ready:
            tee.flush_partial()
            continue
        for key, _ in ready:
            try:
                data = os.read(key.fd, 1 << 16)
            except OSError:
                data = b""
            tee.feed(key.data, data)
            if not data:
                selector.unregister(key.fd)
                os.close(key.fd)


def main(argv: Sequence[str]) -> int:
    for name in IGNORED:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    # The rank blocked these while starting this process; ignored now, they may come.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    path, rank, host, out_fd, err_fd = argv[:5]
    given = json.loads(argv[5]) if len(argv) > 5 else {}
    marks = Marks.of(given.get("secret") or (), given.get("public") or ())
    log_fd = open_append(path)  # no link, no one else's file (owned.py)
    tee = Tee(log_fd, int(rank), host, values_to_mask(os.environ, marks=marks),
              {OUT: 1, ERR: 2})
    run(tee, {OUT: int(out_fd), ERR: int(err_fd)})
    os.close(log_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
