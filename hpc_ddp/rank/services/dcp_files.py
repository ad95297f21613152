"""Writing the sharded checkpoint format: every rank its own part, in parallel.

A sharded checkpoint of step N is a folder (read back by dcp_read.py)::

    checkpoints/step_<N>.dcp/
        __<R>_0.distcp     rank R's tensors (torch.distributed.checkpoint, DCP): its shards of
                           a sharded model (DTensors) and its share of the tensors every rank
                           holds alike, which DCP spreads over the ranks so each is written once
        .metadata          DCP's index of them (rank 0, after every rank's part is written)
        state.pt           rank 0's values that are not tensors (counters, hpc_ddp's record)

It is written into ``.step_<N>.dcp.<attempt>-<save>.tmp`` and renamed to its name by rank 0
only once every rank's part is written (its DCP save returned, its stream file in place: the
store counter of ckpt_writer.py), so a folder ``step_<N>.dcp`` is always whole; ``latest``
then names it (checkpoint.point_latest). DCP's save is a collective (it plans which rank
writes what, and gathers the results to rank 0); it runs in the writer's thread on a Gloo
process group of its own (:func:`checkpoint_group`), so it never mixes with the training's
collectives on the default group. https://pytorch.org/docs/stable/distributed.checkpoint.html
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpc_ddp.rank.services import checkpoint
from hpc_ddp.rank.services.dcp_read import STATE
from hpc_ddp.rundir import fsync_dir


def checkpoint_group(timeout_s: float) -> Any | None:
    """A Gloo process group of every rank for the checkpoints' collectives (None without a
    process group, or alone). A collective itself: every rank makes it at the same call."""
    import torch.distributed as dist  # deferred: torch

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def temp_folder(folder: Path, step: int, attempt: int, save: int) -> Path:
    """Where every rank writes its part of the ``save``-th checkpoint of this attempt (the
    same name on every rank: saves are collective)."""
    return folder / f".step_{step:09d}.dcp.{attempt}-{save}.tmp"


def stage(tensors: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``tensors`` in host memory (DTensors stay DTensors, their local shard
    copied), taken while the step waits; training may change the originals at once."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager  # deferred: torch

    staged: dict[str, Any] = BlockingAsyncStager().stage(tensors)
    return staged


def write_shards(temp: Path, tensors: dict[str, Any], group: Any | None) -> None:
    """This rank's part: DCP's save into ``temp`` (files fsynced), with every rank."""
    import torch.distributed.checkpoint as dcp  # deferred: torch

    temp.mkdir(parents=True, exist_ok=True)
    # No group: one rank alone (never the default group, from this thread).
    with warnings.catch_warnings():  # "assuming ... a single process": it is one, then
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(temp, sync_files=True),
                 process_group=group, no_dist=group is None)


def write_plain(temp: Path, plain: dict[str, Any]) -> None:
    """Rank 0's values that are not tensors, checked to load back as data."""
    checkpoint.write_torch(temp / STATE, plain, temp.parent)


def publish(temp: Path, folder: Path, step: int) -> Path:
    """Rank 0, once every rank's part is in ``temp``: rename it to the checkpoint's name
    (step_<N>.<G>.dcp when an earlier save of this step has the plain name: the folder
    ``latest`` may name is never replaced) and make that durable."""
    fsync_dir(temp)
    generation = 0
    while (final := folder / checkpoint.dcp_name(step, generation)).exists():
        generation += 1
    os.rename(temp, final)
    fsync_dir(folder)
    return final
