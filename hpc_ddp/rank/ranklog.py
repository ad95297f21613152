"""Per-rank logging: every rank writes logs/rank<N>.log with a rank prefix on each line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def setup(path: Path, rank: int, host: str, echo: bool) -> None:
    """Log to ``path``; ``echo`` also to stderr (rank 0, so Slurm's output shows progress).
    stderr itself loses torch's one known meaningless line (quiet_stderr.py)."""
    from hpc_ddp.rank.quiet_stderr import filter_stderr

    filter_stderr()
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank} {host}] %(levelname)s %(message)s",
                            "%H:%M:%S")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(fmt)
    root.addHandler(file_handler)
    if echo:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(fmt)
        root.addHandler(stream)
    root.setLevel(logging.INFO)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"(no log at {path})"
