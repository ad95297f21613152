"""Per-rank logging: every rank writes logs/rank<N>.log, each line with its time, rank and
host (hpc_ddp/ranklines.py), and the program's own output beside it (output.py)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from hpc_ddp.config.secrets import mask, values_to_mask
from hpc_ddp.errors import UserError
from hpc_ddp.owned import Untrusted, open_append
from hpc_ddp.rank.join import output
from hpc_ddp.rank.join.distenv import DistEnv
from hpc_ddp.ranklines import prefix
from hpc_ddp.redact import NO_MARKS, Marks


def setup(path: Path, rank: int, host: str, echo: bool, marks: Marks = NO_MARKS,
          env: DistEnv | None = None, environ: MutableMapping[str, str] | None = None) -> None:
    """Log to ``path``; ``echo`` also to stderr (rank 0, so Slurm's output shows progress).
    With ``env``, this process's stdout and stderr go into ``path`` too (output.capture:
    the program's output, an ATTEMPT line first). Secrets are masked (``marks``: the
    config's secrets.secret / secrets.public). UserError, before anything is written, where
    ``path`` is a symbolic link or someone else's file (owned.open_append)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # the file the handler below writes to (its descriptor: nothing can swap it since)
        log_file = os.fdopen(open_append(path), "a")
    except Untrusted as exc:
        raise UserError("run_dir", str(path.parent.parent), str(exc), "") from None
    if env is not None and output.capture(path, env, host,
                                          os.environ if environ is None else environ, marks):
        # submitit prints its lines to stdout itself (its handler): they reach the log
        # through the capture once, not a second time through the root logger.
        logging.getLogger("submitit").propagate = False
    fmt = LineFormatter(f"%(asctime)s.%(msecs)03d {prefix(rank, host)} %(levelname)s "
                        "%(message)s", "%Y-%m-%d %H:%M:%S")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    hidden = _Masked(values_to_mask(os.environ, marks=marks))
    _MASKED[:] = hidden.values  # for the error file, events and the exception (masked())
    file_handler = logging.StreamHandler(log_file)
    file_handler.setFormatter(fmt)
    file_handler.addFilter(hidden)
    root.addHandler(file_handler)
    if echo:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(fmt)
        stream.addFilter(hidden)
        root.addHandler(stream)
    root.setLevel(logging.INFO)


# The secret values this process's log hides (setup() sets them): every other record of an
# error (logs/rank<N>.error, events.jsonl, its lines file, the exception submitit pickles,
# the report a submit prints) hides the same ones, through masked().
_MASKED: list[str] = []


def masked(text: str) -> str:
    """``text`` with this rank's secrets and any secret-shaped part as **** (docs/security.md)."""
    return mask(text, _MASKED)


class LineFormatter(logging.Formatter):
    """Every line of a record with the time, rank and host (a message or traceback of several
    lines too): a line read alone, or merged with other ranks' (hpc_ddp.logs), says whose."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if "\n" not in text:
            return text
        first, *rest = text.split("\n")
        head = first[:len(first) - len(record.message.split("\n", 1)[0])]  # time, rank, level
        return "\n".join([first, *(head + part for part in rest)])


class _Masked(logging.Filter):
    """Secret values (of this task's secret-named or secret-shaped variables) and any
    secret-shaped text as **** (config/secrets.py, hpc_ddp/redact.py)."""

    def __init__(self, values: list[str]) -> None:
        super().__init__()
        self.values = values

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        masked = mask(text, self.values)
        if masked != text:
            record.msg, record.args = masked, ()
        return True


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"(no log at {path})"
