"""Where a run goes: the launch targets (this machine, a Slurm job, a step of an allocation)
behind one typed seam.

A target is a module with the three functions of :class:`LaunchTarget`; ``cluster.kind``
names it. A new target (another scheduler, a cloud batch service) is a module that provides
them, added to :data:`TARGETS` (docs/architecture.md, "Seams"). Each ``submit`` returns at
once with a handle that has a ``job_id`` and submitit's Job methods (``done()``,
``cancel()``, ``state``); a handle of a process on this machine also carries ``pid`` and
``started`` (launch/local.py, launch/step.py). How a submitted job is then watched and ended
(its state, done, cancel, the poll rate) is the kind's job control, launch/control.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol, cast

from hpc_ddp.config.schema import Config
from hpc_ddp.rundir import RunDir

# cluster.kind -> the module that launches it (imported when chosen: submitit, sbatch
# checks and srun handling load only for the kind in use).
TARGETS = {"local": "hpc_ddp.launch.local", "slurm": "hpc_ddp.launch.slurm",
           "step": "hpc_ddp.launch.step"}


class LaunchTarget(Protocol):
    """What every launch target provides (a module satisfies it structurally)."""

    def submit(self, cfg: Config, run: RunDir, task: Callable[[], Any] | None = None) -> Any:
        """Start ``task`` (default: training) on every rank of ``cfg``; the job's handle."""
        ...

    def describe(self, cfg: Config) -> str:
        """The run's shape in a few words ("2 nodes x 1 task = 2 ranks")."""
        ...

    def dry_run(self, cfg: Config, run: RunDir) -> str:
        """What ``submit`` would do, with nothing started and nothing left behind."""
        ...


def target(kind: str) -> LaunchTarget:
    """The launch target for ``cluster.kind`` ``kind`` (resolved before: never "auto")."""
    if kind not in TARGETS:
        raise ValueError(f"cluster.kind={kind!r} has no launch target; known: "
                         f"{', '.join(TARGETS)}")
    return cast(LaunchTarget, importlib.import_module(TARGETS[kind]))


def counted(n: int, noun: str) -> str:
    """"1 node", "2 nodes": a count with its noun in the number it takes."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
