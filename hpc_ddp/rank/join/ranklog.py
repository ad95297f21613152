"""Per-rank logging: every rank writes logs/rank<N>.log with a rank prefix on each line."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from hpc_ddp.config.secrets import mask, values_to_mask
from hpc_ddp.redact import NO_MARKS, Marks


def setup(path: Path, rank: int, host: str, echo: bool, marks: Marks = NO_MARKS) -> None:
    """Log to ``path``; ``echo`` also to stderr (rank 0, so Slurm's output shows progress).
    stderr itself loses torch's one known meaningless line (quiet_stderr.py). Secrets are
    masked (``marks``: the config's secrets.secret / secrets.public)."""
    # deferred (start-up): rank.join.quiet_stderr
    from hpc_ddp.rank.join.quiet_stderr import filter_stderr

    filter_stderr()
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank} {host}] %(levelname)s %(message)s",
                            "%H:%M:%S")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    hidden = _Masked(values_to_mask(os.environ, marks=marks))
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(fmt)
    file_handler.addFilter(hidden)
    root.addHandler(file_handler)
    if echo:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(fmt)
        stream.addFilter(hidden)
        root.addHandler(stream)
    root.setLevel(logging.INFO)


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
