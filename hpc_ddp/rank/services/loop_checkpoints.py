"""A training loop's checkpoints, ours and a user's alike: save a state with this rank's
random streams, resume from the newest usable one, and keep the restart history.

What is written is the loop's own dict with one key of ours beside its keys::

    {...the loop's state..., "hpc_ddp": {"step", "world_size", "restarts", "program"}}

so the built-in trainer's checkpoint keeps its ``model``/``optimizer``/``counters`` at the
top (docs/run-directory.md) and a user's loop gets back exactly the dict it saved. Writing
goes through one :class:`~hpc_ddp.rank.services.ckpt_writer.CheckpointWriter` (atomic
``latest``, every rank's streams in its own file); reading through
:func:`~hpc_ddp.rank.services.checkpoint.load_for_resume` (data only, the fallback to an
older checkpoint recorded in events.jsonl).

A state that holds a sharded tensor (a DTensor: FSDP2's ``fully_shard``, ``ctx.shard``), or
any state under ``trainer.checkpoint_format=dcp``, is written in the sharded format
(dcp_files.py): every rank passes its own state, writes its own part of the tensors, and
rank 0 the rest; nothing is gathered. Under ``checkpoint_format=full`` a sharded tensor is
gathered whole first (a collective) and rank 0 writes one file. Loading a sharded checkpoint
``into`` a state of sharded tensors fills each with this rank's part, whatever the world size
that saved it (docs/fault-tolerance.md#sharded-checkpoints-dcp).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.config.schema import TrainerConfig
from hpc_ddp.rank.services import checkpoint, dcp_read, rng, tensor_tree
from hpc_ddp.rank.services.ckpt_writer import CheckpointWriter
from hpc_ddp.rundir import RunDir

log = logging.getLogger(__name__)
OURS = "hpc_ddp"
# The key of a rank's own states (keep()) in its file of random streams.
OWN = "own"
# How ctx.save wrote a checkpoint before its keys moved to the top: {"user": ..., OURS: ...}.
_OLD_USER = "user"


class LoopCheckpoints:
    """One rank's view of its loop's checkpoints (every rank makes one; saves are
    collectives). ``program``: what the loop is (recorded; None for the built-in trainer)."""

    def __init__(self, trainer: TrainerConfig, run: RunDir, rank: int, world_size: int,
                 attempt: int, program: str | None) -> None:
        self._trainer, self.run, self.program = trainer, run, program
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self._writer: CheckpointWriter | None = None  # made at the first save
        self.restarts: list[dict[str, Any]] = []  # the history, from the checkpoint on
        self.resumed_from_step: int | None = None
        self.saved_step: int | None = None  # the step of this attempt's last save
        # The world size the resumed checkpoint was written with (None: fresh run).
        self.resumed_world_size: int | None = None
        # This rank's own states beside its random streams, by name: objects with
        # state_dict()/load_state_dict() whose state differs by rank (a DDP communication
        # hook's: services/comm_hooks.py). A loaded state whose object is kept only later
        # waits in _pending until it is.
        self._own: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}

    def keep(self, name: str, owner: Any) -> None:
        """Save ``owner.state_dict()`` in this rank's own file at every save, and hand it
        back to ``owner.load_state_dict`` at a resume (at once if one was loaded already)."""
        self._own[name] = owner
        if name in self._pending:
            owner.load_state_dict(self._pending.pop(name))

    @property
    def kept(self) -> tuple[str, ...]:
        """The names :meth:`keep` was given."""
        return tuple(self._own)

    @property
    def writer(self) -> CheckpointWriter:
        if self._writer is None:
            self._writer = CheckpointWriter.from_config(self._trainer, self.run.checkpoints,
                                                        self.rank, self.world_size,
                                                        self.attempt)
        return self._writer

    def save(self, state: Mapping[str, Any] | None, step: int,
             generators: Mapping[str, Any] | None = None) -> Path:
        """Checkpoint ``step``: ``state`` is this rank's (None on a rank other than 0 means
        the full format: only rank 0's is written), this rank's random streams (and
        ``generators``') everywhere. The copy to host memory happens here, the writing in
        the background; returns the path rank 0's file (or the sharded set's folder) gets."""
        if state is not None and OURS in state:
            raise ValueError(f"a checkpointed state may not use the key {OURS!r} (hpc_ddp "
                             "keeps its own record there): rename that key")
        whole = None
        if state is not None:
            ours = {"step": step, "world_size": self.world_size, "restarts": list(self.restarts),
                    "program": self.program}
            whole = {**state, OURS: ours}
        self.saved_step = step
        streams = rng.capture(dict(generators or {}))
        if self._own:
            streams[OWN] = {name: owner.state_dict() for name, owner in self._own.items()}
        if whole is not None and self.sharded(whole):
            plain, tensors = tensor_tree.split(whole)
            return self.writer.save(step, plain if self.rank == 0 else None, streams,
                                    shards=tensors)
        if whole is not None and tensor_tree.has_dtensor(whole):
            whole = tensor_tree.gathered(whole)  # every rank: full_tensor is a collective
        return self.writer.save(step, whole if self.rank == 0 else None, streams)

    def sharded(self, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` is written in the sharded format (trainer.checkpoint_format)."""
        chosen = self._trainer.checkpoint_format
        return chosen == "dcp" or (chosen == "auto" and tensor_tree.has_dtensor(state))

    def flush(self) -> None:
        """Wait until the last save is on disk (raises if it failed)."""
        if self._writer is not None:
            self._writer.wait()

    def load(self, cause: str, generators: Mapping[str, Any] | None = None,
             check: Callable[[dict[str, Any]], None] | None = None,
             into: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """The loop's state of the newest usable checkpoint (None for a fresh run), with this
        rank's random streams set back to where they were when it was saved. ``check``: takes
        the state and raises if it does not fit (then the checkpoint before is tried, and the
        skip is recorded). ``cause``: why this start resumes (the restart history's).
        ``into``: a state shaped like the one saved (the loop's own, e.g. its sharded model's
        state dict): a sharded checkpoint's tensors of the same name are read into its
        tensors in place, a DTensor getting only this rank's part; without it every tensor
        comes back whole, on the CPU."""
        self.flush()
        templates = tensor_tree.split(dict(into))[1] if into is not None else None

        def accept(whole: dict[str, Any]) -> None:
            _ours_of(whole)  # raises for a file that is not a loop's checkpoint
            if check is not None:
                check(_loop_state(whole))

        def read(path: Path) -> dict[str, Any]:
            if not checkpoint.is_sharded(path):
                return checkpoint.read_data(path, self.run.root)
            return dcp_read.read(path, self.run.root, templates)

        whole = checkpoint.load_for_resume(self.run, self.rank == 0, self.attempt,
                                           accept=accept,
                                           step_of=lambda w: _ours_of(w)["step"], read=read)
        if whole is None:
            return None
        ours = _ours_of(whole)
        step = int(ours["step"])
        self.restarts = [*ours.get("restarts", []), checkpoint.restart_record(step, cause)]
        self.resumed_from_step = step
        saved_world = ours.get("world_size")
        self.resumed_world_size = saved_world if isinstance(saved_world, int) else None
        self._restore_streams(saved_world, step, generators or {})
        log.info("resumed from step %d", step)
        return _loop_state(whole)

    def _restore_streams(self, saved_world: Any, step: int,
                         generators: Mapping[str, Any]) -> None:
        if saved_world != self.world_size:
            log.warning("checkpoint was written with world_size %s, now %d: the ranks' random "
                        "streams (and a communication hook's state) restart; the run is no "
                        "longer bitwise reproducible "
                        "(docs/fault-tolerance.md#resuming-on-another-world-size)",
                        saved_world, self.world_size)
            return
        streams = checkpoint.load_streams(self.run.checkpoints, self.rank, step)
        if streams is None:
            log.warning("rank %d restarts its random streams (and a communication hook's "
                        "state): the run is no longer bitwise reproducible", self.rank)
            return
        rng.restore(streams, dict(generators))
        for name, saved in dict(streams.get(OWN) or {}).items():
            if name in self._own:
                self._own[name].load_state_dict(saved)
            else:
                self._pending[name] = saved


def _ours_of(whole: dict[str, Any]) -> dict[str, Any]:
    """Our record in a checkpoint; one the built-in trainer wrote before the record existed
    (its counters and restarts at the top) gives the same. ValueError for anything else."""
    ours = whole.get(OURS)
    if isinstance(ours, dict) and "step" in ours:
        return ours
    counters = whole.get("counters")
    if isinstance(counters, dict) and "global_step" in counters:
        return {"step": counters["global_step"], "world_size": whole.get("world_size"),
                "restarts": whole.get("restarts", []), "program": None}
    raise ValueError(f"not a checkpoint of an hpc_ddp loop (no {OURS!r} record)")


def _loop_state(whole: dict[str, Any]) -> dict[str, Any]:
    """The loop's own dict of a checkpoint (one of an older layout too)."""
    if set(whole) == {_OLD_USER, OURS}:  # ctx.save's first layout
        old: dict[str, Any] = whole[_OLD_USER]
        return old
    ours = (OURS,) if OURS in whole else ("restarts", "world_size")  # the trainer's first
    return {k: v for k, v in whole.items() if k not in ours}
