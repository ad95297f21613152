"""Checkpoints that survive a crash, a kill or a preemption at any moment.

Written by rank 0 only: a temp file in the same folder, flushed and fsynced, then
``os.replace`` onto its final name (atomic on POSIX), the folder fsynced, then the ``latest``
pointer replaced the same way. At every instant ``latest`` names a complete file.
(submitit's own ``temporary_save_path`` deletes the old file before renaming the new one,
which leaves a window with no checkpoint at all; see FIELD.md.)
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp.procs import pid_alive

log = logging.getLogger(__name__)

LATEST = "latest"
_NAME = re.compile(r"^step_(\d{9})\.pt$")


class CheckpointError(RuntimeError):
    """Saving failed (disk full, permissions); the previous checkpoint is still the latest."""


def name_for(step: int) -> str:
    return f"step_{step:09d}.pt"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[Any], None]) -> None:
    """Call ``write(fileobj)`` into a temp file beside ``path``, fsync, then rename onto it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save(state: dict[str, Any], folder: Path, step: int, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step``, point ``latest`` at it, keep ``keep``."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name_for(step)
    try:
        write_atomic(path, lambda handle: torch.save(state, handle))
        write_atomic(folder / LATEST, lambda handle: handle.write(path.name.encode()))
    except (OSError, RuntimeError) as exc:
        # torch.save wraps a write error (ENOSPC) in a RuntimeError from its zip writer.
        reason = _os_error_in(exc)
        raise CheckpointError(
            f"could not save checkpoint {path} ({reason}); the previous checkpoint "
            f"({latest_path(folder) or 'none'}) is still the latest. Free disk space or fix the "
            "folder's permissions."
        ) from exc
    _prune(folder, keep)
    return path


def _os_error_in(exc: BaseException) -> str:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen.strerror or str(seen)
        seen = seen.__cause__ or seen.__context__
    return str(exc).splitlines()[0]


def _prune(folder: Path, keep: int) -> None:
    steps = sorted(p for p in folder.iterdir() if _NAME.match(p.name))
    current = latest_path(folder)
    for old in steps[:-keep]:
        if old != current:
            old.unlink(missing_ok=True)
    for stale in folder.glob(".*.tmp"):  # leftovers of a writer killed mid-write
        if not _owned_by_live_process(stale):
            stale.unlink(missing_ok=True)


def _owned_by_live_process(tmp: Path) -> bool:
    try:
        pid = int(tmp.name.rsplit(".", 2)[-2])
    except ValueError:
        return False
    return pid == os.getpid() or pid_alive(pid)


def latest_path(folder: Path) -> Path | None:
    """The checkpoint ``latest`` points at (None when there is none yet)."""
    try:
        name = (folder / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    if not _NAME.match(name):
        raise CheckpointError(f"{folder / LATEST} holds {name!r}, not a checkpoint name")
    return folder / name


def load_latest(folder: Path, map_location: Any = "cpu") -> dict[str, Any] | None:
    """The latest checkpoint's state, or None for a fresh run."""
    import torch

    path = latest_path(folder)
    if path is None:
        return None
    log.info("loading checkpoint %s", path)
    state: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=False)
    return state
