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


def latest_step(folder: Path) -> int | None:
    """The step of the checkpoint ``latest`` names (None: none yet, or an unreadable pointer)."""
    try:
        latest = latest_path(folder)
    except CheckpointError:
        return None
    match = _NAME.match(latest.name) if latest is not None else None
    return int(match.group(1)) if match else None


def candidates(folder: Path) -> list[Path]:
    """The checkpoints a resume may start from, best first: the one ``latest`` names, then
    the older kept ones, newest first."""
    latest = latest_path(folder)
    if latest is None:
        return []
    older = sorted((p for p in folder.iterdir() if _NAME.match(p.name) and p.name < latest.name),
                   reverse=True)
    return [latest, *older]


def load_usable(folder: Path, map_location: Any = "cpu",
                accept: Callable[[dict[str, Any]], None] | None = None
                ) -> tuple[dict[str, Any] | None, list[tuple[Path, str]]]:
    """The newest checkpoint that loads (and that ``accept`` takes without raising: the
    trainer's load_state_dict, which refuses wrong shapes), and the ones skipped on the way
    with why. A truncated file, a bad pickle or a state that does not fit costs the steps
    since the previous kept checkpoint, not the run. (None, []) for a fresh run;
    CheckpointError when no kept checkpoint is usable."""
    import torch

    skipped: list[tuple[Path, str]] = []
    for path in candidates(folder):
        try:
            log.info("loading checkpoint %s", path)
            state: dict[str, Any] = torch.load(path, map_location=map_location,
                                               weights_only=False)
            if accept is not None:
                accept(state)
            return state, skipped
        except Exception as exc:  # truncated zip, unpickling error, size mismatch, missing
            reason = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
            log.warning("checkpoint %s cannot be used (%s); trying the one before", path, reason)
            skipped.append((path, reason))
    if skipped:
        shown = "; ".join(f"{p.name}: {why}" for p, why in skipped)
        raise CheckpointError(f"no checkpoint in {folder} can be used ({shown}). Start a new "
                              "run_dir, or put back a good checkpoint and name it in "
                              f"{folder / LATEST}.")
    return None, skipped


def load_latest(folder: Path, map_location: Any = "cpu") -> dict[str, Any] | None:
    """The newest usable checkpoint's state (see load_usable), or None for a fresh run."""
    return load_usable(folder, map_location)[0]


def fallback_event(skipped: list[tuple[Path, str]], used: int | None,
                   attempt: int) -> dict[str, Any]:
    """The events.jsonl line for a resume that skipped unusable checkpoints."""
    return {"kind": "checkpoint_fallback", "attempt": attempt,
            "cause": "; ".join(f"{p.name}: {why}" for p, why in skipped), "used_step": used}
