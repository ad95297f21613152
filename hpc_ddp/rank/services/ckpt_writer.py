"""Checkpoints written in the background: a slow file system never stalls the ranks.

At a checkpoint step each rank copies what it saves to the CPU (rank 0 the state, every rank
its own random streams) and goes on training; a thread of the rank writes the copies
(checkpoint.py: temp file, fsync, rename). The set of a step becomes the latest only when all
of it is on disk: each rank, once its stream file is renamed into place, adds one to a counter
on the job's store (one store operation per rank, whatever the world size); rank 0's thread,
after its own file, waits for the counter to reach the world size and only then replaces
``latest``. A crash or a SIGKILL at any moment therefore leaves the previous set as the
latest, whole.

One write at a time: a save first waits for the previous one (back-pressure when the file
system is slower than the checkpoint interval), and so does :meth:`CheckpointWriter.wait`,
which the trainer and the context call at the end, at a stop (before a requeue or an exit)
and before reading a checkpoint back. A write that failed raises there, on that rank.

In the sharded format (dcp_files.py) every rank also writes its part of the tensors, in the
same thread and before its stream file, with DCP on a Gloo group of its own; the step waits
only for the copy to host memory, and rank 0 renames the set's folder into place once the
counter is full, before ``latest`` names it.

The counter lives on the process group's store (torchrun's, hpc_ddp's rendezvous store, or
a supervisor's), which every rank can reach from any thread: the TCPStore client serialises
its operations.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.rank.services import checkpoint, dcp_files
from hpc_ddp.rank.services.checkpoint import CheckpointError

if TYPE_CHECKING:
    from hpc_ddp.config.schema import TrainerConfig

log = logging.getLogger(__name__)
# Seconds between rank 0's looks at the counter while the others write (one store
# operation each, on rank 0 alone; the others are usually done by the time its file is).
POLL_S = 0.01


def snapshot(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """``value`` with every tensor copied to the CPU (tied tensors stay tied) and its dicts,
    lists and tuples rebuilt, so training may change the originals at once."""
    import torch  # deferred: torch

    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.detach().to("cpu", copy=True)
        return memo[id(value)]
    if isinstance(value, dict):
        out = type(value)() if type(value) is not dict else {}
        for key, item in value.items():
            out[key] = snapshot(item, memo)
        return out
    if isinstance(value, list):
        return [snapshot(item, memo) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(snapshot(item, memo) for item in value)
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return value

    return copy.deepcopy(value)


def group_store() -> Any | None:
    """The store of the default process group (None without one)."""
    import torch.distributed as dist  # deferred: torch

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a torch without it: the writer falls back to a barrier
        return None


class CheckpointWriter:
    """One rank's checkpoint writer (see the module docstring)."""

    @classmethod
    def from_config(cls, trainer: TrainerConfig, folder: Path, rank: int, world_size: int,
                    attempt: int) -> CheckpointWriter:
        """The writer a loop gets, ours or a user's through the Context: keep, timeout and
        background writing from the trainer's config."""
        return cls(folder, rank, world_size, trainer.keep_checkpoints, attempt,
                   trainer.collective_timeout_s, trainer.checkpoint_background)

    def __init__(self, folder: Path, rank: int, world_size: int, keep: int, attempt: int = 0,
                 timeout_s: float = 300.0, background: bool = True, store: Any = None,
                 barrier: Callable[[], None] | None = None) -> None:
        """``attempt``: the job's restart count (a fresh counter key per attempt);
        ``timeout_s``: how long rank 0 waits for the other ranks' files; ``store``: the
        job's store (default: the process group's); ``barrier``: where there is no store,
        what the ranks wait in instead (default: torch.distributed.barrier), writing in the
        foreground."""
        self.folder, self.rank, self.world_size, self.keep = folder, rank, world_size, keep
        self.attempt, self.timeout_s, self.background = attempt, timeout_s, background
        self._store, self._barrier = store, barrier
        self._digest = hashlib.sha1(str(folder).encode()).hexdigest()[:12]
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.saves = 0  # saves so far (bench train counts a window's)
        self.step: int | None = None  # the step being (or last) written
        self._group: Any = None  # the sharded format's Gloo group (made at its first save)
        self._grouped = False

    def save(self, step: int, state: dict[str, Any] | None, streams: dict[str, Any],
             shards: dict[str, Any] | None = None) -> Path:
        """Checkpoint ``step``: ``state`` on rank 0 (None on the others), ``streams`` (this
        rank's rng.capture) everywhere; ``shards``, in the sharded format: this rank's
        tensors by name (tensor_tree.py), on every rank, and ``state`` rank 0's plain part.
        Every rank calls it at the same step. Returns the path rank 0's file (or the set's
        folder) will have once written."""
        self.wait()
        if shards is not None and not self._grouped:
            self._group, self._grouped = dcp_files.checkpoint_group(self.timeout_s), True
        if self.world_size > 1 and self._store is None:
            self._store = group_store()
        # The same key on every rank (saves are collective: the n-th save of this writer is
        # everyone's n-th); rank 0 deletes it once complete.
        self.saves += 1
        key = f"hpc_ddp/checkpoint/{self.attempt}/{self._digest}/{step}/{self.saves}"
        # A copy for the thread; written at once, the state cannot change meanwhile.
        copied = snapshot(state) if state is not None and self.background else state
        if shards is not None and self.background:
            shards = dcp_files.stage(shards)
        self.step = step
        if self.world_size > 1 and self._store is None:
            self._write_with_barrier(step, copied, streams, shards)
        elif self.background:
            self._thread = threading.Thread(target=self._write, name="hpc_ddp-checkpoint",
                                            args=(step, copied, streams, key, shards),
                                            daemon=True)
            self._thread.start()
        else:
            self._write(step, copied, streams, key, shards)
            self._raise()
        if shards is not None:
            return self.folder / checkpoint.dcp_name(step)
        return self.folder / checkpoint.name_for(step)

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the last save is written (raises its error); CheckpointError when it is still
        being written after ``timeout_s``."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                raise CheckpointError(f"the checkpoint of step {self.step} is still being "
                                      f"written after {timeout_s:.0f}s")
            self._thread = None
        self._raise()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _raise(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _write(self, step: int, state: dict[str, Any] | None, streams: dict[str, Any],
               key: str, shards: dict[str, Any] | None = None) -> None:
        try:
            temp = self._write_own(step, streams, shards)
            if self.world_size > 1:
                self._store.add(key, 1)
            if state is None:
                return
            path = None
            if temp is None:
                path = checkpoint.write_state(self.folder, step, state)
            else:
                dcp_files.write_plain(temp, state)
            if self.world_size > 1:
                self._wait_for_all(key, step)
            self._point(step, temp, path)
        except BaseException as exc:
            self._error = exc

    def _write_own(self, step: int, streams: dict[str, Any],
                   shards: dict[str, Any] | None) -> Path | None:
        """This rank's part of the set: its tensors (the sharded format: returns the folder
        they are in) and its stream file."""
        temp = None
        if shards is not None:
            temp = dcp_files.temp_folder(self.folder, step, self.attempt, self.saves)
            try:
                dcp_files.write_shards(temp, shards, self._group)
            except BaseException as exc:  # DCP's CheckpointException is no Exception
                raise CheckpointError(f"could not save the sharded checkpoint of step {step} "
                                      f"({checkpoint.os_error_in(exc)}); the previous "
                                      "checkpoint is still the latest") from exc
        checkpoint.write_streams(self.folder, self.rank, step, streams)
        checkpoint.prune_streams(self.folder, self.rank, step, self.keep)
        return temp

    def _point(self, step: int, temp: Path | None, path: Path | None) -> None:
        """Rank 0, every rank's part written: the set's folder into place, then ``latest``."""
        if temp is not None:
            path = dcp_files.publish(temp, self.folder, step)
        assert path is not None
        checkpoint.point_latest(self.folder, path.name, self.keep)
        log.info("checkpoint %s", path)

    def _wait_for_all(self, key: str, step: int) -> None:
        """Rank 0: until every rank's stream file of ``step`` is written."""
        deadline = time.monotonic() + self.timeout_s
        while (done := int(self._store.add(key, 0))) < self.world_size:
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"only {done} of {self.world_size} ranks wrote their part of the checkpoint "
                    f"of step {step} within {self.timeout_s:.0f}s ({self._missing(step)}), so "
                    f"it is not made the latest ({checkpoint.latest_path(self.folder) or 'none'}"
                    " still is). Their logs say why (a full or slow file system, a dead or "
                    "hung rank).")
            time.sleep(POLL_S)
        try:
            self._store.delete_key(key)
        except Exception:  # an older store without delete: one small key per checkpoint
            pass

    def _missing(self, step: int, most: int = 8) -> str:
        """The first ranks whose stream file of ``step`` is absent (rank 0, once, on this
        error path only: a stat per rank until ``most`` are found)."""
        missing = []
        for r in range(1, self.world_size):
            if not checkpoint.streams_path(self.folder, r, step).exists():
                missing.append(r)
                if len(missing) == most:
                    break
        if not missing:
            return "their files are there now"
        more = " and maybe more" if len(missing) == most else ""
        return "missing: rank " + ", ".join(map(str, missing)) + more

    def _write_with_barrier(self, step: int, state: dict[str, Any] | None,
                            streams: dict[str, Any], shards: dict[str, Any] | None) -> None:
        """No store to count on: write in the foreground, meet, then rank 0 points latest."""
        temp = self._write_own(step, streams, shards)
        path = None
        if state is not None:
            if temp is None:
                path = checkpoint.write_state(self.folder, step, state)
            else:
                dcp_files.write_plain(temp, state)
        if self._barrier is not None:
            self._barrier()
        else:
            import torch.distributed as dist  # deferred: torch

            dist.barrier()
        if state is not None:
            self._point(step, temp, path)
