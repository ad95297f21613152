"""Checkpoints that survive a crash, a kill or a preemption at any moment.

A checkpoint of step N is a set of files::

    checkpoints/step_<N>.pt                 rank 0: model, optimizer, counters (no RNG)
    checkpoints/rng/rank<R>/step_<N>.pt      rank R: its own random streams (rng.py)
    checkpoints/latest                      the name of the newest complete set

or, in the sharded format (dcp_files.py), a folder ``step_<N>.dcp/`` in place of rank 0's
file: every rank's tensors (torch.distributed.checkpoint) and rank 0's other values.

Every file is written as a temp file in its folder, flushed, fsynced, checked to load as data
(``weights_only``, trusted.py), then ``os.replace``'d onto its name (atomic on POSIX) and the
folder fsynced. ``latest`` is replaced the same way, and only once every file of the set is
on disk (ckpt_writer.py waits for every rank's). At every instant ``latest`` names a complete
set. (submitit's own ``temporary_save_path`` deletes the old file before renaming the new one,
which leaves a window with no checkpoint at all: submitit/core/utils.py in
https://github.com/facebookincubator/submitit; docs/fault-tolerance.md.)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_ddp import events
from hpc_ddp.procs import pid_alive
from hpc_ddp.rank.services import trusted
from hpc_ddp.rank.services.trusted import UntrustedCheckpoint
from hpc_ddp.rundir import RunDir, write_atomic

log = logging.getLogger(__name__)

LATEST = "latest"
STREAMS = "rng"
# step_<N>.pt (full) or step_<N>.dcp (sharded); a sharded set saved twice at one step in an
# attempt gets step_<N>.<G>.dcp (G = 1, 2, ...), never replacing the folder `latest` names.
_NAME = re.compile(r"^step_(\d{9})(?:\.(\d+))?\.(pt|dcp)$")
_DCP_TEMP = re.compile(r"^\.step_(\d{9})\.dcp\..*\.tmp$")
# A rank keeps its stream files of the checkpoints rank 0 keeps, and always its own newest
# two: rank 0 may still be writing the step before the one a rank just wrote.
_OWN_NEWEST = 2


class CheckpointError(RuntimeError):
    """Saving failed (disk full, permissions); the previous checkpoint is still the latest."""


def name_for(step: int) -> str:
    return f"step_{step:09d}.pt"


def dcp_name(step: int, generation: int = 0) -> str:
    """The folder of a sharded checkpoint of ``step`` (its ``generation``-th in one attempt)."""
    return f"step_{step:09d}.dcp" if generation == 0 else f"step_{step:09d}.{generation}.dcp"


def step_of(path: Path) -> int | None:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else None


def is_sharded(path: Path) -> bool:
    """A checkpoint in the sharded format (a folder, dcp_files.py)."""
    return path.name.endswith(".dcp")


def _order(path: Path) -> tuple[int, int, str]:
    match = _NAME.match(path.name)
    assert match is not None
    return int(match.group(1)), int(match.group(2) or 0), path.name


def entries(folder: Path) -> list[Path]:
    """The checkpoints in ``folder``, oldest first (complete or not: ``latest`` says)."""
    return sorted((p for p in folder.iterdir() if _NAME.match(p.name)), key=_order)


def streams_path(folder: Path, rank: int, step: int) -> Path:
    """Where rank ``rank`` keeps its random streams of step ``step``."""
    return folder / STREAMS / f"rank{rank}" / name_for(step)


def write_torch(path: Path, state: Any, folder: Path) -> None:
    """torch.save to ``path`` atomically, refused (never made latest) if it would not load
    back as data: the check maps the file (mmap) and unpickles only its structure."""
    import torch  # deferred: torch

    try:
        write_atomic(path, lambda handle: torch.save(state, handle),
                     check=lambda tmp: trusted.load_data(tmp, mmap=True))
    except UntrustedCheckpoint as exc:
        raise CheckpointError(f"not saved: {exc}") from None
    except (OSError, RuntimeError) as exc:
        # torch.save wraps a write error (ENOSPC) in a RuntimeError from its zip writer.
        latest = _latest_or_none(folder)
        raise CheckpointError(
            f"could not save checkpoint {path} ({os_error_in(exc)}); the previous checkpoint "
            f"({latest or 'none'}) is still the latest. Free disk space or fix the folder's "
            "permissions.") from exc


def _latest_or_none(folder: Path) -> Path | None:
    try:
        return latest_path(folder)
    except (CheckpointError, OSError):
        return None


def write_state(folder: Path, step: int, state: dict[str, Any]) -> Path:
    """Rank 0's file of the set (not yet the latest)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name_for(step)
    write_torch(path, state, folder)
    return path


def write_streams(folder: Path, rank: int, step: int, streams: dict[str, Any]) -> Path:
    """This rank's random streams of the set."""
    path = streams_path(folder, rank, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_torch(path, streams, folder)
    return path


def point_latest(folder: Path, name: str, keep: int) -> None:
    """Make the set ``name`` (step_<N>.pt or a sharded folder) the latest (every file of it
    is written), keep ``keep``."""
    try:
        write_atomic(folder / LATEST, lambda handle: handle.write(name.encode()))
    except OSError as exc:
        raise CheckpointError(f"could not point {folder / LATEST} at {name} "
                              f"({os_error_in(exc)}); it still names the previous one") from exc
    _prune(folder, keep)


def save(state: dict[str, Any], folder: Path, step: int, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` (one rank, no stream files), point
    ``latest`` at it, keep ``keep``."""
    path = write_state(folder, step, state)
    point_latest(folder, path.name, keep)
    return path


def os_error_in(exc: BaseException) -> str:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen.strerror or str(seen)
        seen = seen.__cause__ or seen.__context__
    return str(exc).splitlines()[0]


def _prune(folder: Path, keep: int) -> None:
    kept = entries(folder)
    current = latest_path(folder)
    for old in kept[:-keep]:
        if old != current:
            _remove(old)
    _remove_stale_temps(folder)
    if current is not None:  # sharded sets abandoned mid-write: no rank writes one this old
        newest = _order(current)[0]
        for stale in folder.iterdir():
            found = _DCP_TEMP.match(stale.name)
            if found and int(found.group(1)) < newest:
                _remove(stale)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_stale_temps(folder: Path) -> None:
    for stale in folder.glob(".*.tmp"):  # leftovers of a writer killed mid-write
        if stale.is_file() and not _owned_by_live_process(stale):
            stale.unlink(missing_ok=True)


def prune_streams(folder: Path, rank: int, step: int, keep: int) -> None:
    """Remove this rank's stream files of checkpoints rank 0 will not keep once ``step``'s
    set is complete: it keeps the newest ``keep`` of its files, ``step``'s counted (_prune,
    at point_latest). Decided from the checkpoint names, not from rank 0's pruning (which
    may not have happened yet), so every rank keeps the same steps rank 0 does, and its own
    newest two; two listings whatever the world size."""
    own = folder / STREAMS / f"rank{rank}"
    try:
        mine = sorted(p for p in own.iterdir() if _NAME.match(p.name))
    except FileNotFoundError:
        return
    steps = [s for p in entries(folder) if (s := step_of(p)) is not None]
    kept = {name_for(s) for s in sorted({*steps, step})[-keep:]}
    for old in mine[:-_OWN_NEWEST]:
        if old.name not in kept:
            old.unlink(missing_ok=True)
    _remove_stale_temps(own)


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
    return step_of(latest) if latest is not None else None


def candidates(folder: Path) -> list[Path]:
    """The checkpoints a resume may start from, best first: the one ``latest`` names, then
    the older kept ones, newest first."""
    latest = latest_path(folder)
    if latest is None:
        return []
    older = [p for p in entries(folder) if _order(p) < _order(latest)]
    return [latest, *reversed(older)]


def read_data(path: Path, top: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """A checkpoint of either format as data, whole (every tensor in full, on the CPU for a
    sharded one): trusted.py, dcp_read.py."""
    if is_sharded(path):
        from hpc_ddp.rank.services import dcp_read  # deferred: dcp_read (DCP)

        return dcp_read.read(path, top)
    state: dict[str, Any] = trusted.load(path, top, map_location)
    return state


def load_usable(folder: Path, map_location: Any = "cpu",
                accept: Callable[[dict[str, Any]], None] | None = None,
                read: Callable[[Path], dict[str, Any]] | None = None
                ) -> tuple[dict[str, Any] | None, list[tuple[Path, str]]]:
    """The newest checkpoint that loads (and that ``accept`` takes without raising: the
    trainer's load_state_dict, which refuses wrong shapes), and the ones skipped on the way
    with why. A truncated file or a state that does not fit costs the steps since the
    previous kept checkpoint, not the run. (None, []) for a fresh run; CheckpointError when no
    kept checkpoint is usable; UntrustedCheckpoint (never skipped) for one someone else could
    have written or that holds more than data (trusted.py: ``folder`` is a run's
    checkpoints/, checked from its run dir down). ``read``: how one checkpoint is read
    (default :func:`read_data`; a loop's, into its sharded model: loop_checkpoints.py)."""
    skipped: list[tuple[Path, str]] = []
    for path in candidates(folder):
        try:
            log.info("loading checkpoint %s", path)
            state = (read(path) if read is not None
                     else read_data(path, folder.parent, map_location))
            if accept is not None:
                accept(state)
            return state, skipped
        except UntrustedCheckpoint:
            raise
        except Exception as exc:  # truncated zip, size mismatch, missing key
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


def load_streams(folder: Path, rank: int, step: int) -> dict[str, Any] | None:
    """This rank's random streams of step ``step`` (its own file only); None when it is
    missing or unreadable (the caller says the streams restart). UntrustedCheckpoint as
    :func:`load_usable`."""
    path = streams_path(folder, rank, step)
    try:
        streams: dict[str, Any] = trusted.load(path, folder.parent, "cpu")
        return streams
    except UntrustedCheckpoint:
        raise
    except Exception as exc:  # missing (a set from before this layout), truncated
        log.warning("random streams of rank %d at step %d cannot be read from %s (%s)", rank,
                    step, path, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        return None


def load_for_resume(run: RunDir, is_master: bool, attempt: int,
                    accept: Callable[[dict[str, Any]], None] | None = None,
                    step_of: Callable[[dict[str, Any]], int | None] = lambda state: None,
                    read: Callable[[Path], dict[str, Any]] | None = None
                    ) -> dict[str, Any] | None:
    """The state a loop resumes from (ours or a user's, onto the CPU): the newest usable
    checkpoint (load_usable); rank 0 records in events.jsonl which ones it skipped and the
    step it used (``step_of`` the state). None for a fresh run."""
    state, skipped = load_usable(run.checkpoints, "cpu", accept=accept, read=read)
    if skipped and is_master:
        events.append(run.root, fallback_event(
            skipped, None if state is None else step_of(state), attempt))
    return state


def fallback_event(skipped: list[tuple[Path, str]], used: int | None,
                   attempt: int) -> dict[str, Any]:
    """The events.jsonl line for a resume that skipped unusable checkpoints."""
    return {"kind": events.CHECKPOINT_FALLBACK, "attempt": attempt,
            "cause": "; ".join(f"{p.name}: {why}" for p, why in skipped), "used_step": used}


def restart_record(from_step: int, cause: str) -> dict[str, Any]:
    """What a loop adds to its checkpointed restart history when it resumes (the summary's
    restart_history): from which step, why (resume_cause), when."""
    return {"from_step": from_step, "cause": cause, "time": time.time()}
