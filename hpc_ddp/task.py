"""What runs on every rank: join the job (rank.py), train, write the summary.

Used by both paths: submitit pickles a :class:`TrainingTask` (``python -m hpc_ddp.submit``),
and ``python -m hpc_ddp.train`` (srun inside ``jobs/*.sbatch``) calls :func:`run` directly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from hpc_ddp import checkpoint
from hpc_ddp.config.compose import from_yaml
from hpc_ddp.config.schema import Config
from hpc_ddp.distenv import DistEnv, detect
from hpc_ddp.errors import UserError
from hpc_ddp.rank import joined
from hpc_ddp.rundir import RunDir, write_json

log = logging.getLogger(__name__)


class TrainingTask:
    """The picklable callable submitit runs on every task of the job."""

    def __init__(self, config_yaml: str, run_dir: str) -> None:
        self.config_yaml = config_yaml
        self.run_dir = run_dir

    def __call__(self) -> dict[str, Any] | None:
        return run(from_yaml(self.config_yaml), RunDir(Path(self.run_dir)), os.environ)


def run(cfg: Config, run_dir: RunDir, environ: MutableMapping[str, str]) -> dict[str, Any] | None:
    """Train as one rank; returns the summary on rank 0, None elsewhere. Raises on failure."""
    # Refuse a run dir that holds another run before anything joins (nothing is touched).
    cause = resume_cause(cfg, run_dir, detect(environ, cfg.cluster.tasks_per_node))
    with joined(cfg, run_dir, environ) as rank:
        return _train(cfg, rank.env, run_dir, rank.device, rank.host, cause)


def _train(cfg: Config, env: DistEnv, run_dir: RunDir, device: Any, host: str,
           cause: str | None) -> dict[str, Any] | None:
    import torch.distributed as dist

    from hpc_ddp.trainer import Trainer

    trainer = Trainer(cfg, env, run_dir, device)
    if cause is not None:
        trainer.resume_if_possible(cause)
    summary = trainer.train()
    hosts: list[Any] = [None] * env.world_size
    dist.all_gather_object(hosts, host)
    if not env.is_master:
        return None
    summary["hosts"] = hosts
    summary["nodes"] = sorted(set(hosts), key=hosts.index)
    summary["job_id"] = env.job_id
    write_json(run_dir.summary, summary)
    log.info("done: step %d, eval accuracy %s; summary in %s", summary["global_step"],
             summary["eval_accuracy"], run_dir.summary)
    return summary


def resume_cause(cfg: Config, run_dir: RunDir, env: DistEnv) -> str | None:
    """Why this start continues from a checkpoint (None: a fresh run)."""
    has_checkpoint = checkpoint.latest_path(run_dir.checkpoints) is not None
    if env.restart > 0:
        return "requeue"
    if cfg.resume:
        return "resume"
    if has_checkpoint:
        raise UserError("run_dir", str(run_dir.root), "already holds checkpoints of a run.",
                        "pass resume=true to continue it, or choose another run_dir.")
    return None


