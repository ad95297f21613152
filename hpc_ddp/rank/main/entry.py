"""A function entry: the user's own loop, called on every rank with a :class:`Context`.

``entry=my_pkg.train:main`` runs ``main(ctx)`` after the rank joined the job (process group
made for the right backend, device chosen, NCCL environment applied) with the torchrun
variables exported, so library code that reads RANK or LOCAL_RANK works. What ``main``
returns (a dict) goes into summary.json; a stop agreed through ``ctx.should_stop()`` ends in
a requeue like the built-in trainer's.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from hpc_ddp.config.schema import Config
from hpc_ddp.owned import open_owned
from hpc_ddp.rank.context.context import Context
from hpc_ddp.rank.context.current import active
from hpc_ddp.rank.join.joined import Rank
from hpc_ddp.rank.services import rng, stopping
from hpc_ddp.rank.services.stopping import StopRequest, StopTraining
from hpc_ddp.rank.supervise.outcome import write_summary
from hpc_ddp.rundir import RunDir
from hpc_ddp.targets import TargetError, locate
from hpc_ddp.trainer import sync_probe

log = logging.getLogger(__name__)
# A callable given to the Python API that no node could import (a notebook's function) is
# pickled into the run dir under this name and run through from_pickle.
PICKLED = "entry.pkl"
PICKLED_ENTRY = f"{__name__}:from_pickle"


def resolve(path: str) -> Callable[[Context], Any]:
    """The entry function at ``path`` ("pkg.module:function"), checked to take one argument."""
    fn = locate(path, "entry")
    if not callable(fn):
        raise TargetError("entry", path, f"is a {type(fn).__name__}, not a function.",
                          "name a function that takes the context: def main(ctx): ...")
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise TargetError("entry", path, "cannot be called with one argument (the context).",
                          "define it as def main(ctx): ... (docs/your-code.md).") from None
    except ValueError:
        pass  # no signature to check (a builtin): the call will tell
    return fn  # type: ignore[no-any-return]


def call(cfg: Config, rank: Rank, run: RunDir, cause: str | None, stop: StopRequest,
         environ: MutableMapping[str, str], staged: dict[str, Any] | None = None
         ) -> dict[str, Any] | None:
    """Run the entry on this rank; the summary on rank 0 (None elsewhere). ``staged``: the
    data.stage summary (``cfg.data.root`` is then this node's copy)."""
    assert cfg.entry is not None
    fn, name = resolve(cfg.entry), cfg.entry
    if cfg.entry == PICKLED_ENTRY:  # the user's function itself, named as theirs
        fn = load_pickled(run)
        name = (f"{getattr(fn, '__module__', '?')}:"
                f"{getattr(fn, '__qualname__', type(fn).__name__)} (pickled into {PICKLED})")
    environ.update(rank.torchrun_env())
    ctx = Context(cfg, run, rank.env, rank.device, rank.host, stop, cause, joined=rank)
    if staged is not None:
        ctx.summary["data_stage"] = staged
    # Reproducible by default, the same on every rank (a model built before DDP starts equal
    # everywhere); ctx.load() sets a resumed rank's streams back to where they were.
    rng.seed_all(cfg.trainer.seed)
    started = time.perf_counter()
    log.info("running %s on %s (rank %d of %d)", name, rank.device, rank.env.rank,
             rank.env.world_size)
    # How much of a step waits on gradient sync, as the built-in trainer says it.
    probe = sync_probe.for_loop(rank.env.world_size, cfg.trainer.strategy)
    try:
        with active(ctx):
            result = fn(ctx)
    finally:
        if probe is not None:
            probe.close()
    if ctx.stop_code != stopping.NONE:
        if ctx.stopped_at is None:
            log.warning("%s returned after the agreed stop without ctx.save(): the requeued "
                        "job resumes from the last checkpoint", name)
        raise StopTraining(ctx.stop_code, ctx.stopped_at)
    if not rank.env.is_master:
        return None
    summary = {"program": f"entry {name}", "world_size": rank.env.world_size,
               "num_nodes": rank.env.num_nodes, "device": str(rank.device),
               "train_time_s": time.perf_counter() - started, "global_step": ctx.step,
               "resumed_from_step": ctx.resumed_from_step, "restarts": len(ctx.restarts),
               "restart_history": ctx.restarts, **sync_probe.summary_of(probe),
               **jsonable(ctx.summary)}
    returned = jsonable(result if isinstance(result, dict) else {} if result is None
                        else {"result": result})
    summary = {**{k: v for k, v in returned.items() if k not in summary}, **summary,
               "result": returned}
    return write_summary(rank, run, summary)


def jsonable(value: Any) -> Any:
    """``value`` with tensors and numpy numbers as Python numbers (lists for tensors with more
    than one element), anything else unknown as its text, so summary.json can hold it."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and scalars
        return jsonable(value.tolist())
    return str(value)


def from_pickle(ctx: Context) -> Any:
    """Run the callable the Python API pickled into the run dir (call() runs it directly,
    under its own name; this is what ``entry=`` names in the config)."""
    return load_pickled(RunDir(Path(ctx.run_dir)))(ctx)


def load_pickled(run_dir: RunDir) -> Callable[[Context], Any]:
    """The callable the Python API pickled into the run dir (cloudpickle, as submitit), if
    the file and the run dir are this user's and writable by no one else, read from the
    descriptor that was checked (hpc_ddp/owned.py)."""
    # deferred: cloudpickle
    import cloudpickle

    # Code by design: only if no one else could have written it.
    with open_owned(run_dir.root / PICKLED, run_dir.root) as handle:
        fn = cloudpickle.load(handle)
    return fn  # type: ignore[no-any-return]
