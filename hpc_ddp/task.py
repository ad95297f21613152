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

from hpc_ddp import checkpoint, device, diagnose, events, requeue, stopping
from hpc_ddp.config.compose import from_yaml
from hpc_ddp.config.schema import Config
from hpc_ddp.distenv import DistEnv, detect
from hpc_ddp.errors import UserError
from hpc_ddp.rank import Rank, RunStopped, joined
from hpc_ddp.rundir import RunDir, read_json, resume_command, write_json
from hpc_ddp.stopping import StopRequest, StopTraining

log = logging.getLogger(__name__)


class TrainingTask:
    """The picklable callable submitit runs on every task of the job."""

    def __init__(self, config_yaml: str, run_dir: str) -> None:
        self.config_yaml = config_yaml
        self.run_dir = run_dir

    def __call__(self) -> dict[str, Any] | None:
        return run(from_yaml(self.config_yaml), RunDir(Path(self.run_dir)), os.environ)


def run(cfg: Config, run_dir: RunDir, environ: MutableMapping[str, str]) -> dict[str, Any] | None:
    """Train as one rank; returns the summary on rank 0, None elsewhere. Raises on failure.

    A stop signal ends in a checkpoint and a requeue (or a clear exit); a failure of another
    rank ends in a message naming it and, on Slurm, a requeue while restarts remain.
    """
    env = detect(environ, cfg.cluster.tasks_per_node)
    # Refuse a run dir that holds another run before anything joins (nothing is touched).
    cause = resume_cause(cfg, run_dir, env)
    stop = StopRequest()
    stop.install(cfg.cluster.signal)
    with joined(cfg, run_dir, environ) as rank:
        try:
            return _train(cfg, rank, run_dir, cause, stop)
        except StopTraining as stopped:
            _after_stop(stopped, stop, cfg, rank, run_dir, environ)
        except Exception as exc:
            _after_failure(exc, cfg, rank, run_dir, environ)
    return None


def _train(cfg: Config, rank: Rank, run_dir: RunDir, cause: str | None,
           stop: StopRequest) -> dict[str, Any] | None:
    import torch.distributed as dist

    from hpc_ddp.trainer import Trainer

    env = rank.env
    trainer = Trainer(cfg, env, run_dir, rank.device, stop)
    if cause is not None:
        trainer.resume_if_possible(cause)
    summary = trainer.train()
    placed: list[Any] = [None] * env.world_size
    dist.all_gather_object(placed, {"rank": env.rank, "host": rank.host, **(rank.gpu or {})})
    if not env.is_master:
        return None
    hosts = [p["host"] for p in placed]
    summary["hosts"] = hosts
    summary["nodes"] = sorted(set(hosts), key=hosts.index)
    summary["job_id"] = env.job_id
    summary["gpu_map"] = [p for p in placed if p.get("physical") is not None]
    summary["gpu_collisions"] = device.collisions(placed)
    for shared in summary["gpu_collisions"]:
        log.warning("ranks %s share GPU %s on %s", shared["ranks"], shared["gpu"], shared["host"])
    write_json(run_dir.summary, summary)
    hparams = read_json(run_dir.hparams)  # written for sweep points
    if isinstance(hparams, dict) and hparams:
        from hpc_ddp.metrics import write_hparams

        write_hparams(run_dir.tb, hparams, {
            "hparam/eval_accuracy": float(summary["eval_accuracy"] or 0.0),
            "hparam/eval_loss": float(summary["eval_loss"] or 0.0),
            "hparam/final_train_loss": float(summary["final_train_loss"])})
    log.info("done: step %d, eval accuracy %s; summary in %s", summary["global_step"],
             summary["eval_accuracy"], run_dir.summary)
    return summary


def _after_stop(stopped: StopTraining, stop: StopRequest, cfg: Config, rank: Rank,
                run_dir: RunDir, environ: MutableMapping[str, str]) -> None:
    """All ranks stopped at the same step and the checkpoint is written: requeue or exit."""
    if not rank.env.is_master:
        raise SystemExit(0)  # rank 0 decides and reports
    job = requeue.slurm_job(environ)
    left = stopping.time_left_s(job, environ) if job else None
    cause = stopping.cause_of(stopped.code, left, cfg.cluster.signal_delay_s, job is not None)
    record = {"attempt": rank.env.restart, "step": stopped.step, "cause": cause,
              "signals": [name for name, _ in stop.received]}
    resume_hint = resume_command(run_dir.root)
    if job is None:
        events.append(run_dir.root, {"kind": "stop", **record})
        raise RunStopped(f"stopped at step {stopped.step} ({cause}); the checkpoint is saved. "
                         f"Continue with: {resume_hint}")
    if stopped.code == stopping.TERM:
        # Preemption: Slurm itself requeues the job (PreemptMode=REQUEUE); a scancel ends it.
        events.append(run_dir.root, {"kind": "stop", **record})
        log.warning("stopped at step %d on SIGTERM; checkpoint saved", stopped.step)
        raise SystemExit(0)
    used = events.requeues_by_us(events.read(run_dir.root))
    if used >= cfg.cluster.max_restarts:
        events.append(run_dir.root, {"kind": "stop", **record})
        raise RunStopped(f"stopped at step {stopped.step} ({cause}) and not requeued: "
                         f"cluster.max_restarts={cfg.cluster.max_restarts} requeues are used. "
                         f"The checkpoint is saved; continue with: {resume_hint} "
                         "(raise cluster.max_restarts or cluster.time_min for fewer stops).")
    problem = requeue.requeue(job, environ)
    if problem:
        events.append(run_dir.root, {"kind": "stop", **record})
        raise RunStopped(f"stopped at step {stopped.step} ({cause}); the checkpoint is saved "
                         f"but `scontrol requeue {job}` failed: {problem}. Continue with: "
                         f"{resume_hint}")
    events.append(run_dir.root, {"kind": "stop", **record})
    events.append(run_dir.root, {"kind": "requeue", **record})
    log.warning("stopped at step %d (%s): checkpoint saved, job %s requeued (%d of %d)",
                stopped.step, cause, job, used + 1, cfg.cluster.max_restarts)
    raise SystemExit(0)


def _after_failure(exc: Exception, cfg: Config, rank: Rank, run_dir: RunDir,
                   environ: MutableMapping[str, str]) -> None:
    """Name the cause: this rank's own error, or the rank that failed or stopped answering;
    on Slurm requeue from the last checkpoint if allowed and a new attempt may get past it."""
    if diagnose.is_comm_failure(exc):
        message = diagnose.explain(exc, rank.store, rank.env.rank, rank.env.world_size,
                                   run_dir.ranks)
        peer = diagnose.peer_error(run_dir.logs, rank.env.rank, rank.env.world_size)
        if peer is not None:  # a peer failed by itself; its error is the cause, not ours
            message = f"{peer} (this rank's collective failed as a result)"
        retry = peer is None
    else:
        message = f"{diagnose.LOCAL_MARK} {diagnose.own_error(exc)}"
        retry = diagnose.worth_requeue(exc)
    record = {"attempt": rank.env.restart, "rank": rank.env.rank, "host": rank.host,
              "cause": message.replace(diagnose.LOCAL_MARK, "").strip()}
    events.append(run_dir.root, {"kind": "failure", **record})
    if not retry:
        raise RuntimeError(message) from exc  # a new attempt would fail the same way
    job = requeue.slurm_job(environ)
    used = events.requeues_by_us(events.read(run_dir.root))
    if job is not None and used < cfg.cluster.max_restarts and rank.store is not None:
        # One requeue per failure: the first rank to claim it on the store (if still up).
        if _claim(rank.store, f"hpc_ddp/requeue/{rank.env.restart}") and not requeue.requeue(
                job, environ):
            events.append(run_dir.root, {"kind": "requeue", **record})
            message += f" Job {job} requeued from its last checkpoint."
    raise RuntimeError(message) from exc


def _claim(store: Any, key: str) -> bool:
    try:
        return int(store.add(key, 1)) == 1
    except Exception:  # the store died with rank 0: let this rank requeue
        return True


def resume_cause(cfg: Config, run_dir: RunDir, env: DistEnv) -> str | None:
    """Why this start continues from a checkpoint (None: a fresh run)."""
    if env.restart > 0:
        why = events.last_reason(events.read(run_dir.root), env.restart - 1)
        return f"requeue after {why}" if why else "requeue by Slurm (preemption or node failure)"
    if cfg.resume:
        return "resume"
    if checkpoint.latest_path(run_dir.checkpoints) is not None:
        raise UserError("run_dir", str(run_dir.root), "already holds checkpoints of a run.",
                        "pass resume=true to continue it, or choose another run_dir.")
    return None
