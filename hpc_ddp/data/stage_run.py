"""``data.stage=true`` for a run: stage the data on every node, then hand the program the copy.

Which program gets what:
- the built-in trainer and a `_target_` data factory: the config with ``data.root`` (a
  factory: its ``root`` argument, ``data.root=...``) replaced by the node's copy;
- a function entry: the same config as ``ctx.cfg``, and ``ctx.data_root``; ``ctx.stage(path)``
  stages any other folder or tar the same way;
- a script (``script=``): its supervisor stages, and the script finds the copy in
  ``$HPC_DDP_DATA_ROOT`` (:data:`DATA_ROOT_ENV`).

The summary gets ``data_stage``: the nodes that staged and reused, the bytes and files of a
copy, the longest staging time (one all-reduce of four numbers).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from hpc_ddp.config.schema import Config
from hpc_ddp.data.staging import Staged
from hpc_ddp.errors import UserError
from hpc_ddp.rundir import RunDir, write_json

log = logging.getLogger(__name__)


def source_root(cfg: Config) -> str:
    """What ``data.stage`` copies: data.root, or a `_target_` factory's root argument."""
    d = cfg.data
    root = d.kwargs.get("root") if d.target is not None else d.root
    if not root:
        which = ("a `_target_` data factory is given the copy as its root argument"
                 if d.target is not None else f"data={d.name} has no data.root")
        raise UserError("data.root", "null", f"data.stage=true needs the data set to copy: "
                        f"{which}.", "set data.root=/shared/path/to/the/data (a folder or a "
                        "tar), or data.stage=false.")
    return str(root)


def stage_data(cfg: Config, rank: Any, run_dir: RunDir, environ: Mapping[str, str]
               ) -> tuple[Config, dict[str, Any] | None]:
    """(config reading this node's copy, the summary's ``data_stage``); unchanged without
    data.stage. Every rank calls it (a collective)."""
    if not cfg.data.stage:
        return cfg, None
    staged = stage_path(source_root(cfg), cfg, rank, run_dir, environ)
    d = cfg.data
    data = (dataclasses.replace(d, kwargs={**d.kwargs, "root": str(staged.root)})
            if d.target is not None else dataclasses.replace(d, root=str(staged.root)))
    return dataclasses.replace(cfg, data=data), summarize(staged, rank.env)


def stage_path(root: str, cfg: Config, rank: Any, run_dir: RunDir,
               environ: Mapping[str, str], key: str = "data.root") -> Staged:
    """This node's copy of ``root`` (a folder or a tar) under ``data.stage_dir``."""
    from hpc_ddp.data.stage_node import stage  # deferred (start-up): data.stage_node

    report = _progress_writer(run_dir, rank.host) if rank.env.is_master else None
    staged = stage(root, cfg.data.stage_dir, rank.env, rank.host, rank.store, environ, report,
                   key)
    how = ("copied here" if staged.by_me else "an earlier start's copy" if staged.reused
           and rank.env.local_rank == 0 else "this node's copy")
    log.info("data.stage: rank %d on %s reads %s (%s)", rank.env.rank, rank.host, staged.root,
             how)
    return staged


def _progress_writer(run_dir: RunDir, host: str) -> Any:
    """Rank 0's staging progress into progress.json, which ``wait``/``follow`` show."""
    def report(figures: dict[str, Any]) -> None:
        write_json(run_dir.progress, {"step": 0, "total_steps": None, "epoch": None,
                                      "time": time.time(), "stage": {**figures, "host": host}})
    return report


def summarize(staged: Staged, env: Any) -> dict[str, Any]:
    """The job's staging in numbers: nodes that staged (the rank that made a copy counts it)
    and reused (local rank 0 counts it), a copy's size, the longest time. A collective."""
    # deferred: torch
    import torch
    import torch.distributed as dist

    counts: list[float | None] = [float(staged.by_me),
                                  float(staged.reused and env.local_rank == 0), staged.seconds]
    if env.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        counts = [None, None, None]  # a script's supervisor: no group to count with
    elif env.world_size > 1:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        sums = torch.tensor(counts[:2], dtype=torch.float64, device=device)
        longest = torch.tensor(counts[2:], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        counts = [*sums.tolist(), *longest.tolist()]
    def number(value: float | None, digits: int = 0) -> float | int | None:
        return None if value is None else round(value, 3) if digits else int(value)

    return {"source": staged.source, "root": str(staged.root), "bytes": staged.bytes,
            "files": staged.files, "nodes": env.num_nodes, "nodes_staged": number(counts[0]),
            "nodes_reused": number(counts[1]), "seconds_max": number(counts[2], 3),
            "host": staged.host, "seconds": round(staged.seconds, 3), "reused": staged.reused}
